"""Assembly guards: settings that would misbehave at run time are refused before assembly.

ARCHITECTURE §7.3, §7.6 and M2 §1, M2 §3:

- per source ``0 < inter_token < ttft < timeout`` (for whichever are set): the watchdog's
  layers must nest, or the outer one fires first and hides the inner one's meaning;
- ``max timeout <= lease TTL``: a permit lease must not expire while its request still runs;
- ``probe TTL >= max timeout + 5``: a half-open probe must outlive the call it guards;
- ``stall window >= max TTFT``: a slow first token must not read as a stalled scope.

Plus the structural rule of the middleware list (no duplicates; the governed dispatcher is
pinned innermost by assembly, so no layer has to be last) and, given a plugin registry, that
every implementation named exists.

These functions see only resolved settings (which may have been built by hand for
``from_settings``), so they name keys in both spellings: env key and pipeline-file key.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from dataclasses import field
from typing import Protocol

from polygateway.config.kinds import CHAT_CALLS, CallKind
from polygateway.frozen import frozen_dataclass
from polygateway.settings import GatewaySettings, ScopeSettings, SourceConfig

NO_BACKEND = "none"
_NUMBERED = re.compile(r"^([a-z0-9]+(?:_[a-z0-9]+)*)-([0-9]+)$")


class NameRegistry(Protocol):
    """What the guards need of ``polygateway.plugins.Registry``."""

    def names(self, kind: str) -> Sequence[str]: ...

    def unavailable(self) -> Sequence[str]:
        """Plugins that could have provided a missing name (failed to load, or left out by
        ``PGW_PLUGINS``), one line each with its hint."""
        ...


# --------------------------------------------------------------------------- key names


def scope_key(scope: str, env_suffix: str, file_table: str | None, file_key: str) -> str:
    """``LLM__BREAKER__PROBE_TTL_S (file: [scopes.LLM.breaker].probe_ttl_s)``."""
    table = f"scopes.{scope}" + (f".{file_table}" if file_table else "")
    return f"{scope}__{env_suffix} (file: [{table}].{file_key})"


def source_key(scope: str, source: SourceConfig, field: str) -> str:
    """The key that sets ``field`` of ``source``: its env key when the name is ``provider-N``."""
    match = _NUMBERED.match(source.name)
    if match and match.group(1) == source.provider:
        return f"{scope}__{source.provider.upper()}__{match.group(2)}__{field.upper()}"
    return f"[[scopes.{scope}.sources]] name={source.name!r} {field}"


def middleware_key(scope: str) -> str:
    return f"[scopes.{scope}].middleware"


@frozen_dataclass
class WrittenKeys:
    """The keys the user actually wrote, when the loader knows them: problems then name
    ``LLM_TTFT_TIMEOUT`` or ``pgw.toml:[...].ttft_timeout_s`` rather than a spelling the user
    never used."""

    sources: Mapping[tuple[str, str], str] = field(default_factory=dict)
    """(source name, field) -> key."""
    scope: Mapping[tuple[str, ...], str] = field(default_factory=dict)
    """Scope path (``("backpressure", "lease_ttl_s")``) -> key."""


_NOTHING_WRITTEN = WrittenKeys()


# --------------------------------------------------------------------------- guards


def _timeout_chain(
    scope: str, source: SourceConfig, written: WrittenKeys = _NOTHING_WRITTEN
) -> list[str]:
    def key(name: str) -> str:
        return written.sources.get((source.name, name)) or source_key(scope, source, name)

    def origin(name: str) -> str:
        if not written.sources:  # settings built by hand: no idea who set it
            return f"{key(name)}"
        set_by = written.sources.get((source.name, name))
        return f"set by {set_by}" if set_by else f"the default; set {key(name)} to change it"

    problems: list[str] = []
    chain = [
        ("inter_token_timeout_s", source.inter_token_timeout_s),
        ("ttft_timeout_s", source.ttft_timeout_s),
        ("timeout_s", source.timeout_s),
    ]
    present = [(name, value) for name, value in chain if value is not None]
    for name, value in [*present, ("connect_timeout_s", source.connect_timeout_s)]:
        if not value > 0:
            problems.append(f"{key(name)}: must be > 0, got {value:g}")
    for (inner, inner_value), (outer, outer_value) in itertools.pairwise(present):
        if inner_value > 0 and not inner_value < outer_value:
            problems.append(
                f"{key(inner)}: {inner_value:g} must be < {outer.upper()} {outer_value:g} "
                f"({origin(outer)}; rule 0 < inter_token < ttft < timeout, source {source.name})"
            )
    return problems


def middleware_problems(scope: ScopeSettings) -> list[str]:
    """No layer repeated (the order is free: the dispatcher is always innermost)."""
    key = middleware_key(scope.scope)
    layers = list(scope.middleware)
    problems: list[str] = []
    repeated = sorted({name for name in layers if layers.count(name) > 1})
    if repeated:
        problems.append(f"{key}: each layer at most once; repeated: {', '.join(repeated)}")
    return problems


def check_guards(scope: ScopeSettings, written: WrittenKeys = _NOTHING_WRITTEN) -> list[str]:
    """Problems that refuse assembly of ``scope`` (empty list = fine).

    ``written``: the keys the user set (from the loader), named in place of generic spellings.
    """
    name = scope.scope

    def skey(env_suffix: str, table: str, file_key: str) -> str:
        return written.scope.get((table, file_key)) or scope_key(name, env_suffix, table, file_key)

    problems: list[str] = []
    seen: set[str] = set()
    for source in scope.sources:
        if source.name in seen:
            problems.append(
                f"[scopes.{name}.sources] name={source.name!r}: source names must be unique "
                "within a scope"
            )
        seen.add(source.name)
        problems.extend(_timeout_chain(name, source, written))

    if scope.sources:
        longest = max(scope.sources, key=lambda s: s.timeout_s)
        max_timeout = longest.timeout_s
        lease_ttl = scope.lease_ttl_s
        if max_timeout > lease_ttl:
            problems.append(
                f"{skey('BACKPRESSURE__LEASE_TTL_S', 'backpressure', 'lease_ttl_s')}: "
                f"lease TTL {lease_ttl:g} must be >= the longest source timeout {max_timeout:g} "
                f"({longest.name}), or a permit expires while its request still runs"
            )
        probe_ttl = scope.probe_ttl_s
        if probe_ttl < max_timeout + 5.0:
            problems.append(
                f"{skey('BREAKER__PROBE_TTL_S', 'breaker', 'probe_ttl_s')}: "
                f"{probe_ttl:g} must be >= the longest source timeout + 5 = {max_timeout + 5.0:g} "
                f"({longest.name})"
            )
        with_ttft = [s for s in scope.sources if s.ttft_timeout_s is not None]
        if with_ttft:
            slowest = max(with_ttft, key=lambda s: s.ttft_timeout_s or 0.0)
            stall = scope.backpressure.stall_window_s
            if stall < scope.max_ttft_s:
                key = skey("BACKPRESSURE__STALL_WINDOW_S", "backpressure", "stall_window_s")
                problems.append(
                    f"{key}: {stall:g} must be >= the longest TTFT timeout {scope.max_ttft_s:g} "
                    f"({slowest.name}), or a slow first token reads as a stall"
                )
    problems.extend(middleware_problems(scope))
    return problems


# --------------------------------------------------------------------------- registry


def scope_registry_problems(
    scope: ScopeSettings,
    registry: NameRegistry,
    chosen_by: Mapping[str, str] | None = None,
    *,
    call_kind: CallKind = CHAT_CALLS,
) -> list[str]:
    """Every implementation ``scope`` names must be registered under its kind.

    ``chosen_by`` (kind -> key), when the loader knows it, names the key that made a choice
    instead of every key that could have. ``call_kind``: the call kind the scope serves (where
    its sources' ``transport`` names are looked up, whether their providers are profiles).
    """
    name = scope.scope
    transport_kind = call_kind.transport_kind
    cached: dict[str, list[str]] = {}

    def registered(kind: str) -> list[str]:
        if kind not in cached:
            cached[kind] = sorted(registry.names(kind))
        return cached[kind]

    wanted: list[tuple[str, str, str]] = [
        ("limiter", scope.limiter.name, f"PGW_LIMITER_BACKEND / [scopes.{name}.limiter].name"),
        (
            "breaker",
            scope.breaker_backend.name,
            f"PGW_BREAKER_BACKEND / [scopes.{name}.breaker].backend",
        ),
        ("selector", scope.selector, scope_key(name, "SELECTOR", None, "selector")),
        (
            "structured",
            scope.structured_strategy,
            scope_key(name, "STRUCTURED__STRATEGY", "structured", "strategy"),
        ),
    ]
    if scope.cache.backend != NO_BACKEND:
        wanted.append(
            (
                "cache",
                scope.cache.backend,
                f"PGW_CACHE_BACKEND / {scope_key(name, 'CACHE__BACKEND', 'cache', 'backend')}",
            )
        )
    wanted.extend(
        (
            "telemetry",
            backend,
            f"PGW_TELEMETRY_BACKEND / "
            f"{scope_key(name, 'TELEMETRY__BACKEND', 'telemetry', 'backend')}",
        )
        for backend in scope.telemetry.backends
    )
    for source in scope.sources:
        wanted.append((transport_kind, source.transport, source_key(name, source, "transport")))
        if not call_kind.provider_profiles:
            continue
        match = _NUMBERED.match(source.name)
        provider_key = (
            f"{name}__{source.provider.upper()}__{match.group(2)}__*"
            if match and match.group(1) == source.provider
            else source_key(name, source, "provider")
        )
        wanted.append(("provider", source.provider, provider_key))
    wanted.extend(("middleware", layer, middleware_key(name)) for layer in scope.middleware)

    problems: list[str] = []
    hints: list[str] | None = None
    for kind, chosen, generic_key in wanted:
        key = generic_key
        if chosen_by and kind in chosen_by and kind not in (transport_kind, "provider"):
            key = chosen_by[kind]
        names = registered(kind)
        if chosen in names:
            continue
        what = "provider profile" if kind == "provider" else kind
        line = (
            f"{key}: {what} {chosen!r} is not registered; registered {kind} names: "
            f"{', '.join(names) or 'none'}"
        )
        if hints is None:
            hints = list(registry.unavailable())
        if hints:
            # The registry knows no plugin by name; it knows which ones failed or were left out.
            line += " (" + "; ".join(hints) + ")"
        problems.append(line)
    return problems


def validate_against_registry(
    settings: GatewaySettings,
    registry: NameRegistry,
    *,
    call_kinds: Mapping[str, CallKind] | None = None,
) -> list[str]:
    """Every chosen implementation exists in ``registry.names(kind)``, and the middleware order
    is valid; one line per problem, naming the key and the registered names.

    ``call_kinds``: scope name -> the call kind it serves (scopes not named serve chat)."""
    kinds = call_kinds or {}
    problems: list[str] = []
    for name, scope in settings.scopes.items():
        kind = kinds.get(name, CHAT_CALLS)
        problems.extend(scope_registry_problems(scope, registry, call_kind=kind))
        problems.extend(middleware_problems(scope))
    return problems
