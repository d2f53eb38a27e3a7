"""Plugin discovery and the registry of everything plugins provide.

``load_registry()`` builds a fresh pluggy ``PluginManager`` on every call (no module global),
registers the core's builtin plugin, loads the entry points of group ``polygateway`` one by
one (a plugin that fails to import is recorded as failed and never stops the others), then
calls every ``pgw_register_*`` hook with a ``register(name, obj, *, options=None)`` callback.
The result is a ``Registry``: a plain lookup table used at assembly time; requests never touch
pluggy. ``Registry.get`` is typed by kind; ``Registry.build`` validates a component's options with
the model its plugin registered and checks what the factory returned against the kind's Protocol,
so a bad factory fails at startup with a ``PluginError`` naming the plugin.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, overload

import pluggy

from polygateway import __version__, builtin, hookspecs, ports
from polygateway.errors import ConfigError, PluginError
from polygateway.frozen import frozen_dataclass, value_methods
from polygateway.hookspecs import HOOK_KINDS, PROJECT_NAME
from polygateway.installed import FoundEntryPoint, Installed, scan
from polygateway.options import OptionsRef
from polygateway.ports import ComponentContext

if TYPE_CHECKING:
    import argparse

    from pydantic import BaseModel

    from polygateway.ports import (
        CacheBackend,
        EmbeddingTransport,
        Middleware,
        OcrLayoutPort,
        OcrTextPort,
        Pricing,
        ProviderGate,
        ProviderProfile,
        RateLimiter,
        SourceSelector,
        StructuredOutputStrategy,
        TelemetryReader,
        TelemetryRecorder,
        Transport,
        TransportFactory,
    )
    from polygateway.settings import SourceConfig

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = PROJECT_NAME
BUILTIN_DISTRIBUTION = "polygateway-core"
KINDS: tuple[str, ...] = tuple(HOOK_KINDS.values())

PluginStatus = Literal["loaded", "failed"]

LimiterFactory: TypeAlias = "Callable[[ComponentContext[Any]], RateLimiter]"
BreakerFactory: TypeAlias = "Callable[[ComponentContext[Any]], ProviderGate]"
CacheFactory: TypeAlias = "Callable[[ComponentContext[Any]], CacheBackend]"
SelectorFactory: TypeAlias = "Callable[[ComponentContext[Any]], SourceSelector]"
StructuredFactory: TypeAlias = "Callable[[ComponentContext[Any]], StructuredOutputStrategy]"
PricingFactory: TypeAlias = "Callable[[ComponentContext[Any]], Pricing | None]"
TelemetryFactory: TypeAlias = "Callable[[ComponentContext[Any]], TelemetryRecorder]"
MiddlewareFactory: TypeAlias = "Callable[[ComponentContext[Any]], Middleware]"
CommandFactory: TypeAlias = (
    "Callable[[argparse.ArgumentParser], Callable[[argparse.Namespace], int]]"
)

# Kind -> the Protocols what its factory returns must satisfy, one of them (checked once, at
# build time); for ``provider``, the class the registered profile must be.
_PROTOCOLS: dict[str, tuple[type, ...]] = {
    "transport": (ports.Transport,),
    "embedding_transport": (ports.EmbeddingTransport,),
    "ocr_transport": (ports.OcrTextPort, ports.OcrLayoutPort),
    "limiter": (ports.RateLimiter,),
    "breaker": (ports.ProviderGate,),
    "cache": (ports.CacheBackend,),
    "selector": (ports.SourceSelector,),
    "structured": (ports.StructuredOutputStrategy,),
    "pricing": (ports.Pricing,),
    "telemetry": (ports.TelemetryRecorder,),
    "middleware": (ports.Middleware,),
    "provider": (ports.ProviderProfile,),
}


@frozen_dataclass(slots=True)
class Registration:
    """One registered thing: the object, the distribution that registered it, its options model
    (a class, or an ``OptionsRef`` naming one)."""

    obj: Any
    provider: str
    options: type[BaseModel] | OptionsRef | None = None


@frozen_dataclass
class PluginInfo:
    """What one plugin is and what it provides (one row of ``pgw plugins list``)."""

    name: str
    """Distribution name (``pgw-redis``); ``polygateway-core`` for the builtin plugin."""
    version: str
    entry_point: str
    """Entry-point name in group ``polygateway``; empty when not loaded from an entry point."""
    hooks: tuple[str, ...]
    provides: Mapping[str, tuple[str, ...]]
    """Kind -> registered names."""
    status: PluginStatus
    error: str | None = None
    hint: str | None = None
    """What would fix a failed plugin (its missing dependencies), when the loader knows it."""

    @property
    def install_hint(self) -> str:
        return self.hint or f"pip install --force-reinstall {self.name} (or report the error)"


def parse_plugin_filter(value: str | None) -> list[str] | None:
    """Parse ``PGW_PLUGINS``: unset -> ``None`` (all plugins); empty -> ``[]`` (builtin only)."""
    if value is None:
        return None
    return [item.strip() for item in value.split(",") if item.strip()]


def _canonical(name: str) -> str:
    # Distribution names compare like pip compares them (PEP 503).
    return re.sub(r"[-_.]+", "-", name).lower()


def _matches(wanted: str, dist: str, entry_point: str) -> bool:
    """Whether a canonical name designates this plugin (distribution or entry-point name)."""
    return wanted == _canonical(dist) or (bool(entry_point) and wanted == _canonical(entry_point))


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _failure_line(info: PluginInfo) -> str:
    where = f" (entry point {info.entry_point!r})" if info.entry_point else ""
    return f"plugin {info.name}{where} failed to load: {info.error}; try: {info.install_hint}"


class Registry:
    """Everything registered by the loaded plugins, by kind and name. Read-only once built."""

    def __init__(
        self,
        entries: Mapping[tuple[str, str], Registration],
        plugins: Sequence[PluginInfo],
        excluded: Sequence[tuple[str, str]] = (),
    ) -> None:
        self._entries: dict[tuple[str, str], Registration] = dict(entries)
        self._plugins = tuple(plugins)
        # (distribution, entry-point name) of installed plugins that PGW_PLUGINS left out.
        self._excluded = tuple(excluded)

    @property
    def plugins(self) -> list[PluginInfo]:
        """Every plugin that was loaded or tried to load (the builtin first)."""
        return list(self._plugins)

    def names(self, kind: str) -> list[str]:
        self._check_kind(kind)
        return sorted(name for k, name in self._entries if k == kind)

    @overload
    def get(self, kind: Literal["transport"], name: str) -> TransportFactory: ...
    @overload
    def get(
        self, kind: Literal["embedding_transport"], name: str
    ) -> Callable[[SourceConfig], EmbeddingTransport]: ...
    @overload
    def get(
        self, kind: Literal["ocr_transport"], name: str
    ) -> Callable[[SourceConfig], OcrTextPort | OcrLayoutPort]: ...
    @overload
    def get(self, kind: Literal["provider"], name: str) -> ProviderProfile: ...
    @overload
    def get(self, kind: Literal["limiter"], name: str) -> LimiterFactory: ...
    @overload
    def get(self, kind: Literal["breaker"], name: str) -> BreakerFactory: ...
    @overload
    def get(self, kind: Literal["cache"], name: str) -> CacheFactory: ...
    @overload
    def get(self, kind: Literal["selector"], name: str) -> SelectorFactory: ...
    @overload
    def get(self, kind: Literal["structured"], name: str) -> StructuredFactory: ...
    @overload
    def get(self, kind: Literal["pricing"], name: str) -> PricingFactory: ...
    @overload
    def get(self, kind: Literal["telemetry"], name: str) -> TelemetryFactory: ...
    @overload
    def get(self, kind: Literal["telemetry_reader"], name: str) -> TelemetryReader: ...
    @overload
    def get(self, kind: Literal["middleware"], name: str) -> MiddlewareFactory: ...
    @overload
    def get(self, kind: Literal["command"], name: str) -> CommandFactory: ...
    @overload
    def get(self, kind: str, name: str) -> object: ...
    def get(self, kind: str, name: str) -> object:
        """The registered object (a factory, or a ``ProviderProfile`` for ``provider``).

        Typed by kind; the object is returned as registered (nothing checks it here: ``build``
        and ``check`` do, at assembly).
        """
        return self._entry(kind, name).obj

    def provider_of(self, kind: str, name: str) -> str:
        """The distribution that registered ``name`` for ``kind``."""
        return self._entry(kind, name).provider

    def options_of(self, kind: str, name: str) -> type[BaseModel] | None:
        """The options model ``name`` was registered with, or ``None`` (options stay a mapping);
        a model registered by reference is imported here.

        :raises PluginError: the reference names no model, or its ``env_keys`` differ from the
            model's ``EnvKey`` metadata.
        """
        declared = self._entry(kind, name).options
        if not isinstance(declared, OptionsRef):
            return declared
        try:
            model = declared.load()
        # The reference is the plugin's: whatever importing it raises is the plugin's problem.
        except Exception as exc:
            raise PluginError(
                f"{self._blame(kind, name, 'options model')} {declared.model!r} "
                f"cannot be imported: {_one_line(exc)}"
            ) from exc
        from polygateway.options import env_keys

        if env_keys(model) != dict(declared.env_keys):
            raise PluginError(
                f"{self._blame(kind, name, 'options model')} {declared.model!r} declares the "
                f"flat keys {env_keys(model)}, its registration {dict(declared.env_keys)}"
            )
        return model

    def declared_options(self, kind: str, name: str) -> type[BaseModel] | OptionsRef | None:
        """The options ``name`` was registered with, as given (nothing imported)."""
        return self._entry(kind, name).options

    def schemas(self) -> list[tuple[str, str, type[BaseModel]]]:
        """``(kind, name, options model)`` of every component registered with one (imported)."""
        found: list[tuple[str, str, type[BaseModel]]] = []
        for kind, name in sorted(self._entries):
            model = self.options_of(kind, name)
            if model is not None:
                found.append((kind, name, model))
        return found

    def flat_env_keys(self) -> list[tuple[str, str, dict[str, str]]]:
        """``(kind, name, option -> flat env key)`` of every component registered with options,
        read from a reference's ``env_keys`` without importing its model."""
        from polygateway.options import env_keys

        found: list[tuple[str, str, dict[str, str]]] = []
        for (kind, name), entry in sorted(self._entries.items()):
            declared = entry.options
            if isinstance(declared, OptionsRef):
                found.append((kind, name, dict(declared.env_keys)))
            elif declared is not None:
                found.append((kind, name, env_keys(declared)))
        return found

    def resolve_options(self, kind: str, name: str, options: object) -> Any:
        """``options`` validated with the component's model (a mapping as given otherwise).

        An instance of the model, or of a reference's plain values, passes as is (the loader
        already validated it); a mapping a reference's plain reader is sure of gives its value.

        :raises ConfigError: one line per problem, ``limiter 'redis' option url: ...``.
        """
        declared = self.declared_options(kind, name)
        if isinstance(declared, OptionsRef) and declared.plain is not None:
            if isinstance(options, declared.plain):
                return options
            if isinstance(options, Mapping) and declared.read_plain is not None:
                plain = declared.read_plain(options)
                if plain is not None:
                    return plain
        model = self.options_of(kind, name)
        if model is None or isinstance(options, model):
            return options
        if not isinstance(options, Mapping):
            raise ConfigError(
                f"{kind} {name!r}: options must be a mapping or a {model.__name__}, "
                f"got {type(options).__name__}"
            )
        from polygateway.config.layer_models import validate_options

        def label(loc: tuple[str | int, ...]) -> str:
            return f"{kind} {name!r} option " + ".".join(map(str, loc))

        validated, problems = validate_options(dict(options), model, label)
        if problems or validated is None:
            raise ConfigError(problems)
        return validated

    @overload
    def build(
        self, kind: Literal["limiter"], name: str, ctx: ComponentContext[Any]
    ) -> RateLimiter: ...
    @overload
    def build(
        self, kind: Literal["breaker"], name: str, ctx: ComponentContext[Any]
    ) -> ProviderGate: ...
    @overload
    def build(
        self, kind: Literal["cache"], name: str, ctx: ComponentContext[Any]
    ) -> CacheBackend: ...
    @overload
    def build(
        self, kind: Literal["selector"], name: str, ctx: ComponentContext[Any]
    ) -> SourceSelector: ...
    @overload
    def build(
        self, kind: Literal["structured"], name: str, ctx: ComponentContext[Any]
    ) -> StructuredOutputStrategy: ...
    @overload
    def build(
        self, kind: Literal["pricing"], name: str, ctx: ComponentContext[Any]
    ) -> Pricing | None: ...
    @overload
    def build(
        self, kind: Literal["telemetry"], name: str, ctx: ComponentContext[Any]
    ) -> TelemetryRecorder: ...
    @overload
    def build(
        self, kind: Literal["middleware"], name: str, ctx: ComponentContext[Any]
    ) -> Middleware: ...
    @overload
    def build(self, kind: str, name: str, ctx: ComponentContext[Any]) -> object: ...
    def build(self, kind: str, name: str, ctx: ComponentContext[Any]) -> object:
        """Build one component: options validated (``resolve_options``), factory called, the
        result checked against the kind's Protocol (``check``).

        :raises ConfigError: invalid options. :raises PluginError: an unknown name, or the
            factory returned something that does not satisfy the kind's Protocol.
        """
        factory = self._entry(kind, name).obj
        options = self.resolve_options(kind, name, ctx.options)
        if options is not ctx.options:
            ctx = dataclasses.replace(ctx, options=options)
        if not callable(factory):
            raise PluginError(self._blame(kind, name, "registered a non-callable"))
        return self.check(kind, name, self._call(kind, name, factory, ctx))

    def build_transport(
        self,
        name: str,
        source: SourceConfig,
        providers: Mapping[str, ProviderProfile],
    ) -> Transport:
        """The transport ``name`` for ``source``, checked like ``build`` checks components."""
        factory = self.get("transport", name)
        if not callable(factory):
            raise PluginError(self._blame("transport", name, "registered a non-callable"))
        transport: Transport = self.check(
            "transport", name, self._call("transport", name, factory, source, providers)
        )
        return transport

    def check(self, kind: str, name: str, obj: Any) -> Any:
        """``obj`` if it satisfies the Protocol of ``kind`` (methods present, the async ones
        ``async def``); else ``PluginError`` naming the plugin and what is missing. A kind with
        several Protocols (``ocr_transport``) needs one of them."""
        protocols = _PROTOCOLS.get(kind)
        if protocols is None or (kind == "pricing" and obj is None):
            return obj
        verdicts = [_verdict(protocol, obj) for protocol in protocols]
        if any(not problem for problem in verdicts):
            return obj
        # Name the closest Protocol's gaps.
        problem = min(verdicts, key=len)
        raise PluginError(
            self._blame(kind, name, f"its factory returned {type(obj).__qualname__}, {problem}")
        )

    def build_source_port(
        self, kind: Literal["embedding_transport", "ocr_transport"], name: str, source: SourceConfig
    ) -> Any:
        """The ``kind`` transport ``name`` for ``source`` (``factory(source)``), checked like
        ``build`` checks components."""
        factory: Any = self.get(kind, name)
        if not callable(factory):
            raise PluginError(self._blame(kind, name, "registered a non-callable"))
        return self.check(kind, name, self._call(kind, name, factory, source))

    def unavailable(self) -> list[str]:
        """Lines for plugins that could have provided a missing name: failed ones (with an
        install hint) and installed ones that ``PGW_PLUGINS`` left out."""
        lines = [_failure_line(p) for p in self._plugins if p.status == "failed"]
        if self._excluded:
            lines.append(
                "plugins installed but not loaded (not in PGW_PLUGINS): "
                + ", ".join(sorted({dist for dist, _ in self._excluded}))
            )
        return lines

    def require_plugin(self, dist_name: str) -> None:
        """Raise ``PluginError`` unless the plugin ``dist_name`` (or entry-point name) loaded."""
        wanted = _canonical(dist_name)
        matches = [p for p in self._plugins if _matches(wanted, p.name, p.entry_point)]
        failed = [p for p in matches if p.status == "failed"]
        if failed:
            raise PluginError([_failure_line(p) for p in failed])
        if matches:
            return
        if any(_matches(wanted, dist, ep_name) for dist, ep_name in self._excluded):
            raise PluginError(
                f"plugin {dist_name} is installed but PGW_PLUGINS does not include it"
            )
        raise PluginError(
            f"plugin {dist_name} is not installed (no distribution with a polygateway entry "
            "point by that name); install the distribution that provides it"
        )

    def _call(self, kind: str, name: str, factory: Any, *args: Any) -> Any:
        """Run a factory; a dependency it imports late and that is missing is a
        ``PluginError`` naming the plugin and the module, not a raw traceback."""
        try:
            return factory(*args)
        except ImportError as exc:
            module = exc.name or str(exc)
            raise PluginError(
                self._blame(
                    kind,
                    name,
                    f"needs module {module!r}, which is not installed; try: pip install {module}",
                )
            ) from exc

    def _blame(self, kind: str, name: str, what: str) -> str:
        return f"{kind} {name!r} (plugin {self.provider_of(kind, name)}): {what}"

    def _entry(self, kind: str, name: str) -> Registration:
        self._check_kind(kind)
        found = self._entries.get((kind, name))
        if found is not None:
            return found
        registered = ", ".join(self.names(kind)) or "none"
        problems = [f"unknown {kind} {name!r}; registered {kind} names: {registered}"]
        problems.extend(self.unavailable())
        raise PluginError(problems)

    @staticmethod
    def _check_kind(kind: str) -> None:
        if kind not in KINDS:
            raise PluginError(f"unknown plugin kind {kind!r}; kinds: {', '.join(KINDS)}")

    def __repr__(self) -> str:
        loaded = sum(p.status == "loaded" for p in self._plugins)
        return f"<Registry {loaded}/{len(self._plugins)} plugins, {len(self._entries)} entries>"


def _protocol_members(protocol: type) -> list[tuple[str, bool]]:
    """``(name, is async)`` of the methods a Protocol declares (its own and its bases')."""
    members: dict[str, bool] = {}
    for klass in reversed(protocol.__mro__):
        if klass is object or not getattr(klass, "_is_protocol", False):
            continue
        for member, value in vars(klass).items():
            if member.startswith("_") and member != "__call__":
                continue
            if callable(value) or isinstance(value, property):
                members[member] = inspect.iscoroutinefunction(value)
    return sorted(members.items())


def _verdict(protocol: type, obj: object) -> str:
    """What keeps ``obj`` from being a ``protocol`` ("" when nothing does)."""
    members = _protocol_members(protocol)
    missing = [member for member, _ in members if not hasattr(obj, member)]
    if missing or not isinstance(obj, protocol):
        detail = f" (missing: {', '.join(missing)})" if missing else ""
        return f"which is not a {protocol.__name__}{detail}"
    not_async = [member for member, is_async in members if is_async and not _is_async(obj, member)]
    if not_async:
        return f"whose {', '.join(not_async)} must be async def ({protocol.__name__})"
    return ""


def _is_async(obj: object, member: str) -> bool:
    if member == "__call__" and inspect.iscoroutinefunction(obj):
        return True  # a plain ``async def`` function used as the callable
    return inspect.iscoroutinefunction(getattr(obj, member, None))


@value_methods
@dataclass(repr=False, eq=False)
class _Candidate:
    """A plugin on its way into the registry (mutable while loading, frozen afterwards)."""

    dist: str
    version: str
    entry_point: str
    plugin: object | None = None
    errors: list[str] = field(default_factory=list)
    provides: dict[str, list[str]] = field(default_factory=dict)
    hooks: tuple[str, ...] = ()
    hint: str | None = None

    def freeze(self) -> PluginInfo:
        provides = {
            kind: tuple(sorted(self.provides[kind])) for kind in KINDS if self.provides.get(kind)
        }
        return PluginInfo(
            name=self.dist,
            version=self.version,
            entry_point=self.entry_point,
            hooks=self.hooks,
            provides=MappingProxyType(provides),
            status="failed" if self.errors else "loaded",
            error="; ".join(self.errors) if self.errors else None,
            hint=self.hint if self.errors else None,
        )


def _distribution_version(installed: Installed, dist: str, fallback: str) -> str:
    try:
        version = installed.version(dist)
    except LookupError:
        return fallback
    return fallback if version is None else version


_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def _missing_requirements(installed: Installed, requirements: Iterable[str]) -> list[str]:
    """The declared dependencies (``Requires-Dist`` lines) that are not installed
    (unconditional ones only: a requirement with an environment marker or an extra is not
    judged here).

    A plugin imports its heavy dependencies lazily (when a factory runs), so importing it
    proves nothing; without this a missing ``redis`` would surface as a raw
    ``ModuleNotFoundError`` at the first call."""
    missing: list[str] = []
    for requirement in requirements:
        match = _REQUIREMENT.match(requirement)
        if match is None or ";" in requirement:
            continue
        if not installed.has(match.group(1)):
            missing.append(requirement.strip())
    return missing


def _module_hint(exc: BaseException) -> str | None:
    """For a missing module: what to install (the module's name is usually its distribution's)."""
    if not isinstance(exc, ModuleNotFoundError):
        return None
    named = exc.name or next(iter(re.findall(r"No module named '([^']+)'", str(exc))), None)
    if named:
        top = named.split(".")[0]
        return f"pip install {top} (the distribution that provides module {top!r})"
    return None


def _pip_hint(requirements: Sequence[str]) -> str:
    quoted = [f"'{r}'" if set(r) & set("<>=!~ ") else r for r in requirements]
    return "pip install " + " ".join(quoted)


def _discover(
    installed: Installed, allowed: Sequence[str] | None
) -> tuple[list[tuple[_Candidate, FoundEntryPoint]], list[tuple[str, str]]]:
    """Entry points of group ``polygateway`` that pass the filter, and the names left out."""
    allowed_set = None if allowed is None else {_canonical(a) for a in allowed}
    chosen: list[tuple[_Candidate, FoundEntryPoint]] = []
    excluded: list[tuple[str, str]] = []
    matched: set[str] = set()
    for ep in sorted(
        installed.entry_points(ENTRY_POINT_GROUP),
        key=lambda ep: (ep.dist or "", ep.name),
    ):
        # An entry point of no distribution is named by itself.
        dist = ep.name if ep.dist is None else ep.dist
        version = "unknown" if ep.dist is None or ep.version is None else ep.version
        if _canonical(dist) == BUILTIN_DISTRIBUTION:
            continue  # the builtin plugin is always registered directly
        if allowed_set is not None and not any(
            _matches(name, dist, ep.name) for name in allowed_set
        ):
            excluded.append((dist, ep.name))
            continue
        matched.update({_canonical(ep.name), _canonical(dist)})
        chosen.append((_Candidate(dist=dist, version=version, entry_point=ep.name), ep))
    if allowed_set:
        unmatched = sorted(allowed_set - matched - {BUILTIN_DISTRIBUTION})
        if unmatched:
            logger.warning(
                "PGW_PLUGINS names %s but no installed plugin matches", ", ".join(unmatched)
            )
    return chosen, excluded


def _add_to_manager(pm: pluggy.PluginManager, candidate: _Candidate, plugin: object) -> None:
    """Register one plugin object, recording a validation failure on the candidate."""
    pluggy_name = f"{candidate.dist}:{candidate.entry_point}"
    try:
        pm.register(plugin, name=pluggy_name)
    except (pluggy.PluginValidationError, ValueError) as exc:
        candidate.errors.append(_one_line(exc))
        return
    unknown = [
        caller.name
        for caller in pm.get_hookcallers(plugin) or []
        if not caller.has_spec()
        and any(impl.plugin is plugin and not impl.optionalhook for impl in caller.get_hookimpls())
    ]
    if unknown:
        import difflib  # only to name a misspelt hook: not on every start

        pm.unregister(plugin)
        for hook_name in unknown:
            close = difflib.get_close_matches(hook_name, HOOK_KINDS, n=1)
            suggestion = f" (did you mean {close[0]!r}?)" if close else ""
            candidate.errors.append(f"unknown hook {hook_name!r}{suggestion}")
        return
    candidate.plugin = plugin


def _collect(
    pm: pluggy.PluginManager,
    candidate: _Candidate,
    entries: dict[tuple[str, str], Registration],
    conflicts: list[str],
) -> None:
    """Call every registration hook the plugin implements, one hook at a time.

    A hook that raises contributes nothing and marks the plugin failed; the plugin's other
    hooks still count (one broken capability should not hide the rest of a plugin).
    """
    plugin = candidate.plugin
    callers = sorted(pm.get_hookcallers(plugin) or [], key=lambda c: c.name)
    candidate.hooks = tuple(c.name for c in callers)
    for caller in callers:
        kind = HOOK_KINDS[caller.name]
        for impl in caller.get_hookimpls():
            if impl.plugin is not plugin:
                continue
            registered = _call_registration_hook(impl, caller.name, kind, candidate)
            if registered is None:
                continue
            for name, obj, options in registered:
                previous = entries.get((kind, name))
                if previous is not None:
                    conflicts.append(
                        f"{kind} {name!r} is registered by both {previous.provider} and "
                        f"{candidate.dist}; uninstall one or leave one out of PGW_PLUGINS"
                    )
                    continue
                entries[(kind, name)] = Registration(obj, candidate.dist, options)
                candidate.provides.setdefault(kind, []).append(name)


def _call_registration_hook(
    impl: pluggy.HookImpl, hook_name: str, kind: str, candidate: _Candidate
) -> list[tuple[str, Any, type[BaseModel] | OptionsRef | None]] | None:
    """Run one hook implementation; its registrations, or ``None`` (and an error) if it failed."""
    if impl.hookwrapper or impl.wrapper:
        candidate.errors.append(f"{hook_name}: registration hooks cannot be wrappers")
        return None
    registered: list[tuple[str, Any, type[BaseModel] | OptionsRef | None]] = []
    seen: set[str] = set()

    def register(name: str, obj: Any, /, *, options: type[Any] | OptionsRef | None = None) -> None:
        if not isinstance(name, str) or not name:
            raise PluginError(f"register() needs a non-empty string name, got {name!r}")
        if name in seen:
            raise PluginError(f"{kind} {name!r} registered twice by the same plugin")
        if isinstance(options, OptionsRef):
            _check_reference(kind, name, options)
        elif options is not None:
            from pydantic import BaseModel

            if not (isinstance(options, type) and issubclass(options, BaseModel)):
                raise PluginError(
                    f"{kind} {name!r}: options= must be a pydantic model class "
                    f"(a polygateway.options.ComponentOptions subclass), got {options!r}"
                )
        seen.add(name)
        registered.append((name, obj, options))

    arguments: dict[str, ports.Register] = {"register": register}
    try:
        result = impl.function(*(arguments[arg] for arg in impl.argnames))
    # A plugin is third-party code: whatever it raises must not stop the other plugins.
    except Exception as exc:
        logger.debug("plugin %s: %s raised", candidate.dist, hook_name, exc_info=True)
        candidate.errors.append(f"{hook_name} raised {_one_line(exc)}")
        candidate.hint = _module_hint(exc) or candidate.hint
        return None
    if inspect.isawaitable(result):
        close = getattr(result, "close", None)
        if callable(close):
            close()  # never awaited: close it so no "coroutine was never awaited" warning
        candidate.errors.append(f"{hook_name}: registration hooks must be plain functions")
        return None
    return registered


def _check_reference(kind: str, name: str, options: OptionsRef) -> None:
    """What a reference must hold to be read without its model (the model is checked on import)."""
    module, colon, attribute = options.model.partition(":")
    if not (module and colon and attribute.isidentifier()):
        raise PluginError(
            f"{kind} {name!r}: OptionsRef needs 'package.module:ClassName', got {options.model!r}"
        )
    if (options.plain is None) != (options.read_plain is None):
        raise PluginError(
            f"{kind} {name!r}: OptionsRef needs both plain= and read_plain=, or neither"
        )
    bad = [
        f"{option}={key}"
        for option, key in options.env_keys.items()
        if not (isinstance(option, str) and isinstance(key, str) and option and key)
    ]
    if bad:
        raise PluginError(f"{kind} {name!r}: OptionsRef env_keys must map strings: {bad}")


def load_registry(
    *,
    allowed: Sequence[str] | None = None,
    autoload: bool = True,
    extra_plugins: Iterable[tuple[str, object]] = (),
) -> Registry:
    """Discover plugins and build the registry.

    :param allowed: ``PGW_PLUGINS`` parsed by ``parse_plugin_filter``: ``None`` loads every
        installed plugin, ``[]`` only the builtin one; names match the entry-point name or the
        distribution name. The builtin plugin and ``extra_plugins`` always load.
    :param autoload: ``False`` skips entry-point discovery (tests).
    :param extra_plugins: ``(distribution name, plugin object)`` pairs registered after the
        discovered ones, through the same path (a module or an object with hookimpls).
    :raises PluginError: two plugins registered the same name for the same kind.
    """
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(hookspecs)

    installed = scan()
    builtin_candidate = _Candidate(
        dist=BUILTIN_DISTRIBUTION,
        version=_distribution_version(installed, BUILTIN_DISTRIBUTION, __version__),
        entry_point="",
    )
    staged: list[tuple[_Candidate, object | None]] = [(builtin_candidate, builtin)]

    excluded: list[tuple[str, str]] = []
    if autoload:
        discovered, excluded = _discover(installed, allowed)
        for candidate, item in discovered:
            try:
                plugin = item.load()
            # Importing a plugin runs third-party code: any failure is that plugin's alone.
            except Exception as exc:
                logger.debug("plugin %s failed to import", candidate.dist, exc_info=True)
                candidate.errors.append(_one_line(exc))
                candidate.hint = _module_hint(exc) or candidate.hint
                plugin = None
            missing = _missing_requirements(installed, item.requirements)
            if missing:
                if plugin is not None:
                    candidate.errors.append(
                        f"ModuleNotFoundError: missing dependency {', '.join(missing)}"
                    )
                plugin = None  # its factories would fail at the first call: refuse it now
                candidate.hint = _pip_hint(missing)
            staged.append((candidate, plugin))
    for dist, plugin in extra_plugins:
        version = str(getattr(plugin, "__version__", "unknown"))
        staged.append((_Candidate(dist=dist, version=version, entry_point=""), plugin))

    for candidate, plugin in staged:
        if plugin is not None:
            _add_to_manager(pm, candidate, plugin)
    pm.check_pending()  # safety net: unknown hooks were already refused plugin by plugin

    entries: dict[tuple[str, str], Registration] = {}
    conflicts: list[str] = []
    for candidate, _ in staged:
        if candidate.plugin is not None:
            _collect(pm, candidate, entries, conflicts)
    if conflicts:
        raise PluginError(conflicts)

    infos = [candidate.freeze() for candidate, _ in staged]
    for info in infos:
        if info.status == "failed":
            logger.warning("%s", _failure_line(info))
    return Registry(entries, infos, excluded=excluded)
