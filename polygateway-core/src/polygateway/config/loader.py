"""Resolve env, ``.env`` and the pipeline file into validated ``GatewaySettings``.

Precedence, lowest to highest (more specific wins; at the same level env wins over the file):

1. built-in defaults (``polygateway.settings``);
2. the file's ``[defaults]`` table;
3. flat env keys (``LLM_TIMEOUT``, ``LLM_MAX_RETRIES``..., ``PGW_*_BACKEND``);
4. the file's ``[scopes.X]`` table (its ``source_defaults`` for source fields);
5. ``{SCOPE}__...`` env keys;

and for one source's fields, above all of those: its ``[[scopes.X.sources]]`` entry, then its
``{SCOPE}__{PROVIDER}__{N}__{FIELD}`` env keys. Within one layer a specific key beats the
``state`` shorthand. A file entry named ``{provider}-{N}`` (the default name of the N-th entry of
that provider) and env keys ``{SCOPE}__{PROVIDER}__{N}__*`` are the same source, so the file can
describe a source and the env supply its key.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from polygateway.config import env as envkeys
from polygateway.config import pipeline as pipefile
from polygateway.config.guards import NO_BACKEND, check_guards, scope_registry_problems
from polygateway.config.models import (
    Loc,
    MaskedOptions,
    ScopeCommonLayer,
    SourceLayer,
    validate_layer,
)
from polygateway.errors import ConfigError
from polygateway.settings import (
    BackpressureSettings,
    BreakerSettings,
    CacheSettings,
    ComponentChoice,
    GatewaySettings,
    Limits,
    RetrySettings,
    ScopeSettings,
    Secret,
    SourceConfig,
    TelemetrySettings,
)

if TYPE_CHECKING:
    from polygateway.config.guards import NameRegistry

STATE_TARGETS: dict[Loc, str] = {
    ("limiter", "name"): "limiter",
    ("breaker", "backend"): "breaker",
    ("cache", "backend"): "cache",
}
"""What the ``state`` shorthand (``PGW_STATE_BACKEND``) sets."""

DEFAULT_BACKEND = "memory"
DEFAULT_CACHE_NAMESPACE = "default"
DEFAULT_CACHE_TTL_S = 3600.0
REDIS = "redis"
POSTGRES = "postgres"
EMBEDDING_SCOPE = "EMBED"
# ``+cluster`` selects a Redis Cluster client (pgw-redis).
_REDIS_SCHEMES = ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")
_PG_SCHEMES = ("postgresql://", "postgres://")

_SOURCE_ARGS = (
    "timeout_s",
    "connect_timeout_s",
    "ttft_timeout_s",
    "inter_token_timeout_s",
    "est_tokens",
    "enable_thinking",
    "missing_done",
    "transport",
)
_LIMIT_ARGS = ("max_concurrency", "rpm", "tpm")

Label = Callable[[Loc], str]

GUARD_FIELDS = frozenset(
    {
        "timeout_s",
        "connect_timeout_s",
        "ttft_timeout_s",
        "inter_token_timeout_s",
        "lease_ttl_s",
        "probe_ttl_s",
        "stall_window_s",
        "cooldown_s",
    }
)
"""Fields the guards read: when one was rejected, the guards would judge a default instead."""

REGISTRY_CHOICES: dict[str, Loc] = {
    "limiter": ("limiter", "name"),
    "breaker": ("breaker", "backend"),
    "cache": ("cache", "backend"),
    "telemetry": ("telemetry", "backend"),
    "selector": ("selector",),
    "structured": ("structured", "strategy"),
    "middleware": ("middleware",),
}
"""Kind -> where the scope's choice of that kind lives (to name the key that made it)."""


def _rejected(raw: Mapping[str, Any], accepted: Mapping[str, Any]) -> set[str]:
    """Names of the values given in ``raw`` that validation dropped."""
    names: set[str] = set()
    for name, value in raw.items():
        kept = accepted.get(name)
        if kept is None:
            names.add(name)
            if isinstance(value, Mapping):
                names |= _rejected(value, {})
        elif isinstance(value, Mapping) and isinstance(kept, Mapping):
            names |= _rejected(value, kept)
    return names


@dataclass
class _Layer:
    data: dict[str, Any]
    label: Label


@dataclass
class _Resolved:
    """Merged values plus, for each leaf, the key that set it (for messages)."""

    values: dict[str, Any] = field(default_factory=dict)
    keys: dict[Loc, str] = field(default_factory=dict)

    def table(self, name: str) -> dict[str, Any]:
        found = self.values.get(name)
        return found if isinstance(found, dict) else {}


def _merge(
    target: dict[str, Any],
    keys: dict[Loc, str],
    data: Mapping[str, Any],
    label: Label,
    path: Loc = (),
) -> None:
    for name, value in data.items():
        here = (*path, name)
        if isinstance(value, dict):
            node = target.get(name)
            if not isinstance(node, dict):
                node = target[name] = {}
            _merge(node, keys, value, label, here)
        else:
            target[name] = copy.deepcopy(value)
            keys[here] = label(here)


def _get(data: Mapping[str, Any], path: Loc) -> Any:
    node: Any = data
    for part in path:
        if not isinstance(node, Mapping):
            return None
        node = node.get(part)
    return node


def _set(data: dict[str, Any], path: Loc, value: Any) -> None:
    node = data
    for part in path[:-1]:
        child = node.get(str(part))
        if not isinstance(child, dict):
            child = node[str(part)] = {}
        node = child
    node[str(path[-1])] = value


def _resolve_layers(layers: list[_Layer]) -> _Resolved:
    resolved = _Resolved()
    for layer in layers:
        _merge(resolved.values, resolved.keys, layer.data, layer.label)
        state = layer.data.get("state")
        if state is None:
            continue
        for path in STATE_TARGETS:
            if _get(layer.data, path) is None:
                _set(resolved.values, path, state)
                resolved.keys[path] = layer.label(("state",))
    return resolved


def _with_env_refs(
    data: dict[str, Any], label: Label, env: Mapping[str, str], pairs: list[tuple[Loc, Loc]]
) -> tuple[dict[str, Any], Label, list[str]]:
    """Replace ``*_env`` indirections (``api_key_env = "QWEN_KEY"``) by the env value they name.

    Secrets belong in the environment; the file names the variable. The value takes the place
    (and the precedence) of the inline key, and messages name the ``*_env`` key.
    """
    problems: list[str] = []
    renamed: dict[Loc, Loc] = {}
    for inline, indirect in pairs:
        var = _get(data, indirect)
        if var is None:
            continue
        parent = _get(data, indirect[:-1]) if len(indirect) > 1 else data
        if isinstance(parent, dict):
            parent.pop(str(indirect[-1]), None)
        if _get(data, inline) is not None:
            problems.append(
                f"{label(inline)}: set only one of {inline[-1]} and {indirect[-1]} "
                f"(prefer {indirect[-1]}: secrets belong in the environment)"
            )
            continue
        value = env.get(var, "").strip()
        if not value:
            problems.append(f"{label(indirect)}: env key {var} is not set")
            continue
        _set(data, inline, value)
        renamed[inline] = indirect

    def relabel(loc: Loc) -> str:
        return label(renamed.get(loc, loc))

    return data, relabel, problems


@dataclass
class _SourceDraft:
    name: str
    provider: str
    values: dict[str, Any]
    keys: dict[Loc, str]
    file_label: Label | None = None
    env_source: envkeys.EnvSource | None = None
    rejected: set[str] = field(default_factory=set)
    """Fields given with a bad value (already reported; not "required" again)."""

    def apply(self, data: Mapping[str, Any], label: Label) -> None:
        _merge(self.values, self.keys, data, label)

    def key(self, name: str) -> str:
        found = self.keys.get((name,))
        if found:
            return found
        names = []
        if self.file_label is not None:
            names.append(self.file_label((name,)))
        if self.env_source is not None:
            names.append(self.env_source.key_for(name))
        return names[0] + (f" (or {names[1]})" if len(names) > 1 else "")


@dataclass
class _Inputs:
    """Everything read once per load, shared by every scope."""

    env: dict[str, str]
    env_config: envkeys.EnvConfig
    pipeline: pipefile.PipelineFile | None
    flat: _Layer
    defaults: _Layer | None
    problems: list[str]
    shared_invalid: bool
    """A shared layer had a guarded value rejected: the guards would judge a default instead."""


def _read_inputs(
    env: Mapping[str, str] | None,
    pipeline_path: str | os.PathLike[str] | None,
    dotenv_path: str | os.PathLike[str] | None,
) -> _Inputs:
    problems: list[str] = []
    try:
        values = envkeys.read_env(env, dotenv_path=dotenv_path)
    except ConfigError as exc:
        problems.extend(exc.problems)
        values = dict(os.environ if env is None else env)

    pipeline: pipefile.PipelineFile | None = None
    path, missing = pipefile.locate(values, pipeline_path)
    if missing:
        problems.append(missing)
    if path is not None:
        pipeline, file_problems = pipefile.read(path)
        problems.extend(file_problems)

    known = list(pipeline.scopes) if pipeline else []
    env_config = envkeys.parse_env(values, known_scopes=known)
    problems.extend(env_config.problems)
    shared_problems: list[str] = []
    rejected: set[str] = set()

    flat_keys = env_config.flat_keys

    def flat_label(loc: Loc) -> str:
        return flat_keys.get(loc) or ".".join(map(str, loc))

    flat_data, flat_problems = validate_layer(env_config.flat, ScopeCommonLayer, flat_label)
    shared_problems.extend(flat_problems)
    rejected |= _rejected(env_config.flat, flat_data)
    flat = _Layer(flat_data, flat_label)

    defaults: _Layer | None = None
    if pipeline is not None and pipeline.defaults is not None:
        file = pipeline

        def defaults_label(loc: Loc) -> str:
            return file.key(("defaults", *loc))

        data, found = validate_layer(pipeline.defaults, ScopeCommonLayer, defaults_label)
        shared_problems.extend(found)
        rejected |= _rejected(pipeline.defaults, data)
        data, label, found = _with_env_refs(
            data, defaults_label, values, [(("telemetry", "pg_dsn"), ("telemetry", "pg_dsn_env"))]
        )
        shared_problems.extend(found)
        defaults = _Layer(data, label)

    if env_config.redis_url is not None and not env_config.redis_url.startswith(_REDIS_SCHEMES):
        shared_problems.append(
            f"{envkeys.REDIS_URL_KEY}: must start with {', '.join(_REDIS_SCHEMES)} "
            "(value not shown: it may hold a password)"
        )
    problems.extend(shared_problems)
    return _Inputs(
        env=values,
        env_config=env_config,
        pipeline=pipeline,
        flat=flat,
        defaults=defaults,
        problems=problems,
        shared_invalid=bool(rejected & GUARD_FIELDS),
    )


def _scope_names(inputs: _Inputs) -> list[str]:
    names = list(inputs.pipeline.scopes) if inputs.pipeline else []
    names.extend(sorted(set(inputs.env_config.scopes) - set(names)))
    return names


def _build_scope(
    name: str, inputs: _Inputs, registry: NameRegistry | None
) -> tuple[ScopeSettings | None, list[str]]:
    """One scope's settings, or ``None`` with the problems that prevent it."""
    problems: list[str] = []
    invalid = inputs.shared_invalid

    file = inputs.pipeline
    file_scope = file.scopes.get(name) if file else None
    env_scope = inputs.env_config.scopes.get(name)

    layers: list[_Layer] = []
    if inputs.defaults is not None:
        layers.append(inputs.defaults)
    layers.append(inputs.flat)
    if file is not None and file_scope is not None:
        fscope = file_scope
        pfile = file

        def scope_label(loc: Loc) -> str:
            return pfile.scope_key(fscope, loc)

        data, found = validate_layer(fscope.settings, ScopeCommonLayer, scope_label)
        invalid = invalid or bool(_rejected(fscope.settings, data) & GUARD_FIELDS)
        data, label, more = _with_env_refs(
            data, scope_label, inputs.env, [(("telemetry", "pg_dsn"), ("telemetry", "pg_dsn_env"))]
        )
        problems.extend(found + more)
        layers.append(_Layer(data, label))
    if env_scope is not None:
        problems.extend(env_scope.problems)
        escope = env_scope

        def env_label(loc: Loc) -> str:
            return escope.keys.get(loc) or f"{name}__" + "__".join(str(p).upper() for p in loc)

        data, found = validate_layer(env_scope.settings, ScopeCommonLayer, env_label)
        problems.extend(found)
        invalid = invalid or bool(_rejected(env_scope.settings, data) & GUARD_FIELDS)
        layers.append(_Layer(data, env_label))

    resolved = _resolve_layers(layers)
    drafts, found = _source_drafts(name, resolved, file, file_scope, env_scope, inputs.env)
    problems.extend(found)
    invalid = invalid or any(draft.rejected & GUARD_FIELDS for draft in drafts)

    sources: list[SourceConfig] = []
    for draft in drafts:
        source, found = _build_source(name, draft)
        problems.extend(found)
        if source is not None:
            sources.append(source)

    scope, found = _build_scope_settings(name, resolved, tuple(sources), inputs)
    problems.extend(found)
    if scope is None:
        return None, problems
    if not invalid:
        # Guards on defaults standing in for rejected values would only add noise.
        problems.extend(check_guards(scope))
    if registry is not None:
        chosen_by = {
            kind: resolved.keys[path]
            for kind, path in REGISTRY_CHOICES.items()
            if path in resolved.keys
        }
        problems.extend(scope_registry_problems(scope, registry, chosen_by))
    return (None if problems else scope), problems


def _source_drafts(
    scope: str,
    resolved: _Resolved,
    file: pipefile.PipelineFile | None,
    file_scope: pipefile.FileScope | None,
    env_scope: envkeys.EnvScope | None,
    env: Mapping[str, str],
) -> tuple[list[_SourceDraft], list[str]]:
    problems: list[str] = []
    base = resolved.table("source_defaults")
    base_keys = {
        loc[1:]: key for loc, key in resolved.keys.items() if loc[:1] == ("source_defaults",)
    }
    drafts: dict[str, _SourceDraft] = {}

    if file is not None and file_scope is not None:
        per_provider: dict[str, int] = {}
        for index, entry in enumerate(file_scope.sources):
            if entry is None:
                continue
            label = _file_source_label(file, file_scope, index)
            data, found = validate_layer(entry, SourceLayer, label)
            data, label, more = _with_env_refs(data, label, env, [(("api_key",), ("api_key_env",))])
            problems.extend(found + more)
            rejected = set(entry) - set(data) - {"api_key_env"}
            provider = data.pop("provider", None)
            if provider is None:
                if "provider" not in entry:
                    problems.append(
                        f"{label(('provider',))}: required (the provider profile name, e.g. qwen)"
                    )
                continue
            provider = str(provider).lower()
            per_provider[provider] = per_provider.get(provider, 0) + 1
            source_name = data.pop("name", None) or f"{provider}-{per_provider[provider]}"
            if source_name in drafts:
                problems.append(
                    f"{label(('name',))}: source name {source_name!r} is already used in "
                    f"[scopes.{file_scope.table_key}]; names must be unique within a scope"
                )
                continue
            draft = _SourceDraft(
                source_name,
                provider,
                copy.deepcopy(base),
                dict(base_keys),
                file_label=label,
                rejected=rejected,
            )
            draft.apply(data, label)
            drafts[source_name] = draft

    if env_scope is not None:
        for env_source in env_scope.ordered_sources():
            env_label = _env_source_label(env_source)
            data, found = validate_layer(env_source.values, SourceLayer, env_label)
            problems.extend(found)
            existing = drafts.get(env_source.name)
            if existing is not None and existing.provider != env_source.provider:
                problems.append(
                    f"{env_source.prefix}__*: source {env_source.name!r} is defined in the "
                    f"pipeline file with provider {existing.provider!r}, not "
                    f"{env_source.provider!r}"
                )
                continue
            if existing is None:
                existing = drafts[env_source.name] = _SourceDraft(
                    env_source.name, env_source.provider, copy.deepcopy(base), dict(base_keys)
                )
            existing.env_source = env_source
            existing.rejected |= set(env_source.values) - set(data)
            existing.apply(data, env_label)
    return list(drafts.values()), problems


def _env_source_label(source: envkeys.EnvSource) -> Label:
    def label(loc: Loc) -> str:
        return source.key_for(str(loc[0]))

    return label


def _file_source_label(file: pipefile.PipelineFile, scope: pipefile.FileScope, index: int) -> Label:
    def label(loc: Loc) -> str:
        return file.source_key(scope, index, loc)

    return label


def _build_source(scope: str, draft: _SourceDraft) -> tuple[SourceConfig | None, list[str]]:
    values = draft.values
    problems = [
        f"{draft.key(name)}: required (source {draft.name})"
        for name in ("base_url", "model")
        if values.get(name) is None and name not in draft.rejected
    ]
    if draft.rejected & {"base_url", "model"}:
        return None, problems
    if problems:
        return None, problems
    options = MaskedOptions(values.get("options") or {})
    for option in ("engine", "trust_env"):
        if option in values:
            options[option] = values[option]
    kwargs = {name: values[name] for name in _SOURCE_ARGS if name in values}
    limits = Limits(**{name: values[name] for name in _LIMIT_ARGS if name in values})
    source = SourceConfig(
        name=draft.name,
        provider=draft.provider,
        base_url=str(values["base_url"]),
        model=str(values["model"]),
        api_key=Secret(str(values.get("api_key") or "")),
        scope=scope,
        limits=limits,
        options=options,
        **kwargs,
    )
    return source, []


def _picked(resolved: _Resolved, path: Loc, value: str) -> str:
    key = resolved.keys.get(path)
    return f"{key}={value}" if key else f"the default {value}"


def _build_scope_settings(
    name: str, resolved: _Resolved, sources: tuple[SourceConfig, ...], inputs: _Inputs
) -> tuple[ScopeSettings | None, list[str]]:
    problems: list[str] = []
    values = resolved.values

    retry = RetrySettings(**resolved.table("retry"))
    if retry.base_delay_s > retry.max_delay_s:
        key = resolved.keys.get(("retry", "max_delay_s")) or resolved.keys.get(
            ("retry", "base_delay_s"), f"{name}__RETRY__MAX_DELAY_S"
        )
        problems.append(
            f"{key}: max_delay_s {retry.max_delay_s:g} must be >= base_delay_s "
            f"{retry.base_delay_s:g}"
        )
    breaker_table = resolved.table("breaker")
    breaker = BreakerSettings(
        **{
            k: breaker_table[k]
            for k in ("fail_threshold", "cooldown_s", "probe_ttl_s")
            if k in breaker_table
        }
    )
    limiter_table = resolved.table("limiter")
    limiter = ComponentChoice(
        str(limiter_table.get("name", DEFAULT_BACKEND)),
        MaskedOptions(limiter_table.get("options", {})),
    )
    breaker_backend = ComponentChoice(
        str(breaker_table.get("backend", DEFAULT_BACKEND)),
        MaskedOptions(breaker_table.get("options", {})),
    )

    cache, found = _cache_settings(name, resolved)
    problems.extend(found)
    telemetry, found = _telemetry_settings(name, resolved)
    problems.extend(found)

    redis_url = inputs.env_config.redis_url
    if not redis_url:
        # One line per key that chose Redis (PGW_STATE_BACKEND chooses it for three parts).
        choosers: dict[str, list[str]] = {}
        for path, what in STATE_TARGETS.items():
            if _get(values, path) == REDIS:
                choosers.setdefault(_picked(resolved, path, REDIS), []).append(what)
        problems.extend(
            f"{envkeys.REDIS_URL_KEY}: required because {chooser} selects Redis for the "
            f"{', '.join(parts)}"
            for chooser, parts in choosers.items()
        )

    pricing_path = values.get("pricing_path")
    if pricing_path is not None:
        pricing_path = str(pricing_path)
        if not (os.path.isfile(pricing_path) and os.access(pricing_path, os.R_OK)):
            problems.append(
                f"{resolved.keys.get(('pricing_path',), 'PGW_PRICING_PATH')}: "
                f"file not found or not readable: {pricing_path}"
            )

    structured = resolved.table("structured")
    middleware_options = {
        layer: MaskedOptions(options)
        for layer, options in resolved.table("middleware_options").items()
    }

    batch_size = values.get("batch_size")
    if name == EMBEDDING_SCOPE and sources and batch_size is None:
        problems.append(
            f"{name}__BATCH_SIZE (file: [scopes.{name}].batch_size): required for the embedding "
            "scope (batching changes behaviour, so it has no default)"
        )

    kwargs: dict[str, Any] = {}
    if "selector" in values:
        kwargs["selector"] = str(values["selector"])
    if "strategy" in structured:
        kwargs["structured_strategy"] = str(structured["strategy"])
    if "max_retries" in structured:
        kwargs["max_structured_retries"] = int(structured["max_retries"])
    if "middleware" in values:
        kwargs["middleware"] = tuple(str(layer) for layer in values["middleware"])
    scope = ScopeSettings(
        scope=name,
        sources=sources,
        retry=retry,
        breaker=breaker,
        backpressure=BackpressureSettings(**resolved.table("backpressure")),
        global_limits=Limits(**resolved.table("global")),
        limiter=limiter,
        breaker_backend=breaker_backend,
        cache=cache,
        telemetry=telemetry,
        pricing_path=pricing_path,
        middleware_options=middleware_options,
        redis_url=Secret(redis_url) if redis_url else None,
        batch_size=int(batch_size) if batch_size is not None else None,
        batch_concurrency=int(values.get("batch_concurrency", 1)),
        **kwargs,
    )
    for layer in middleware_options:
        if layer not in scope.middleware:
            key = next(
                (k for loc, k in resolved.keys.items() if loc[:2] == ("middleware_options", layer)),
                f"[scopes.{name}.middleware_options.{layer}]",
            )
            problems.append(
                f"{key}: options for middleware {layer!r}, which is not in the middleware list "
                f"{list(scope.middleware)}"
            )
    return scope, problems


def _cache_settings(name: str, resolved: _Resolved) -> tuple[CacheSettings, list[str]]:
    table = resolved.table("cache")
    backend = str(table.get("backend", DEFAULT_BACKEND))
    namespace = table.get("namespace")
    ttl_s = table.get("ttl_s")
    problems: list[str] = []
    if backend != NO_BACKEND:
        chosen = resolved.keys.get(("cache", "backend"))
        if chosen is None:
            # Nothing chose a cache: the in-memory default works out of the box.
            namespace = namespace if namespace is not None else DEFAULT_CACHE_NAMESPACE
            ttl_s = ttl_s if ttl_s is not None else DEFAULT_CACHE_TTL_S
        else:
            why = f"required when a cache backend is chosen ({chosen}={backend}); " + (
                "set PGW_CACHE_BACKEND=none to turn the cache off"
            )
            if namespace is None:
                problems.append(
                    f"PGW_CACHE_NAMESPACE (or {name}__CACHE__NAMESPACE, file: "
                    f"[scopes.{name}.cache].namespace): {why}"
                )
            if ttl_s is None:
                problems.append(
                    f"PGW_CACHE_TTL_S (or {name}__CACHE__TTL_S, file: "
                    f"[scopes.{name}.cache].ttl_s): must be > 0 and is {why}"
                )
    cache = CacheSettings(
        backend=backend,
        namespace=str(namespace) if namespace is not None else None,
        ttl_s=float(ttl_s) if ttl_s is not None else None,
        options=MaskedOptions(table.get("options", {})),
    )
    return cache, problems


def _telemetry_settings(name: str, resolved: _Resolved) -> tuple[TelemetrySettings, list[str]]:
    table = resolved.table("telemetry")
    kwargs: dict[str, Any] = {}
    if "backend" in table:
        kwargs["backend"] = str(table["backend"])
    if "sqlite_path" in table:
        kwargs["sqlite_path"] = str(table["sqlite_path"])
    dsn = table.get("pg_dsn")
    telemetry = TelemetrySettings(
        pg_dsn=Secret(str(dsn)) if dsn else None,
        options=MaskedOptions(table.get("options", {})),
        **kwargs,
    )
    problems: list[str] = []
    if dsn is not None and not str(dsn).startswith(_PG_SCHEMES):
        key = resolved.keys.get(("telemetry", "pg_dsn"), "PGW_TELEMETRY_PG_DSN")
        problems.append(
            f"{key}: must be a postgresql:// URL (value not shown: it may hold a password)"
        )
    if telemetry.backend == POSTGRES and not dsn:
        problems.append(
            f"PGW_TELEMETRY_PG_DSN (or file: [scopes.{name}.telemetry].pg_dsn_env): required "
            f"because {_picked(resolved, ('telemetry', 'backend'), POSTGRES)} (scope {name})"
        )
    return telemetry, problems


def _unique(lines: list[str]) -> list[str]:
    return list(dict.fromkeys(lines))


def no_sources_problem(scope: str) -> str:
    return (
        f"{scope}: no sources configured; set {scope}__<PROVIDER>__<N>__BASE_URL and "
        f"{scope}__<PROVIDER>__<N>__MODEL (e.g. {scope}__QWEN__1__BASE_URL, "
        f"{scope}__QWEN__1__MODEL, {scope}__QWEN__1__API_KEY) or add [[scopes.{scope}.sources]] "
        "to the pipeline file"
    )


def load_settings(
    env: Mapping[str, str] | None = None,
    *,
    pipeline_path: str | os.PathLike[str] | None = None,
    dotenv_path: str | os.PathLike[str] | None = None,
    registry: NameRegistry | None = None,
) -> GatewaySettings:
    """Every scope found in env, ``.env`` and the pipeline file, validated and guarded.

    :param env: ``None`` reads ``os.environ`` over ``.env`` (``./.env`` or ``dotenv_path``);
        a mapping is used as-is (over ``dotenv_path`` only when given).
    :param pipeline_path: the TOML pipeline file; default ``PGW_CONFIG``, else ``./pgw.toml``
        when present; no file means defaults.
    :param registry: when given, every implementation name is checked against it.
    :raises ConfigError: with one line per problem, naming the key; secrets never shown.
    """
    inputs = _read_inputs(env, pipeline_path, dotenv_path)
    problems = list(inputs.problems)
    scopes: dict[str, ScopeSettings] = {}
    for name in _scope_names(inputs):
        scope, found = _build_scope(name, inputs, registry)
        problems.extend(found)
        if scope is not None:
            scopes[name] = scope
    if problems:
        raise ConfigError(_unique(problems))
    return GatewaySettings(scopes=scopes)


def load_scope(
    scope: str = "LLM",
    env: Mapping[str, str] | None = None,
    *,
    pipeline_path: str | os.PathLike[str] | None = None,
    dotenv_path: str | os.PathLike[str] | None = None,
    registry: NameRegistry | None = None,
) -> ScopeSettings:
    """One scope's settings (same arguments as ``load_settings``).

    Only this scope's problems (and those of shared keys) are raised: a half-configured other
    scope does not stop this one. A scope without sources is a ``ConfigError`` naming the keys
    that would define one.
    """
    name = scope.upper()
    inputs = _read_inputs(env, pipeline_path, dotenv_path)
    problems = list(inputs.problems)
    built: ScopeSettings | None = None
    if name in _scope_names(inputs):
        built, found = _build_scope(name, inputs, registry)
        problems.extend(found)
        if built is not None and not built.sources:
            problems.append(no_sources_problem(name))
    else:
        problems.append(no_sources_problem(name))
    if problems or built is None:
        raise ConfigError(_unique(problems))
    return built
