"""Scope building: one scope's layers merged, its sources built, its settings checked.

The merged values become a ``ScopeSettings``; problems name the key that set a value (or the
keys that could set a missing one). The guards run on the result unless a value they read was
rejected (they would judge a default instead).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from polygateway.config import components
from polygateway.config.components import DEFAULT_BACKEND, backend_names, fanout_problems
from polygateway.config.guards import (
    NO_BACKEND,
    WrittenKeys,
    check_guards,
    scope_registry_problems,
)
from polygateway.config.kinds import CHAT_CALLS, CallKind, health_probe_problems
from polygateway.config.layer_values import SCOPE_COMMON
from polygateway.config.merge import Layer, Resolved, get_path, rejected_names, resolve_layers
from polygateway.config.models import Loc, MaskedOptions, validate_layer
from polygateway.config.sources import build_source, source_drafts
from polygateway.settings import (
    BackpressureSettings,
    BreakerSettings,
    CacheSettings,
    ComponentChoice,
    Limits,
    RetrySettings,
    ScopeSettings,
    SourceConfig,
    TelemetrySettings,
)

if TYPE_CHECKING:
    from polygateway.config.components import ConfigRegistry
    from polygateway.config.inputs import Inputs

DEFAULT_CACHE_NAMESPACE = "default"
DEFAULT_CACHE_TTL_S = 3600.0
EMBEDDING_SCOPE = "EMBED"

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


def build_scope(
    name: str,
    inputs: Inputs,
    registry: ConfigRegistry | None,
    call_kind: CallKind = CHAT_CALLS,
) -> tuple[ScopeSettings | None, list[str]]:
    """One scope's settings, or ``None`` with the problems that prevent it (its sources read
    as ``call_kind`` says)."""
    problems: list[str] = []
    invalid = inputs.shared_invalid

    file = inputs.pipeline
    file_scope = file.scopes.get(name) if file else None
    env_scope = inputs.env_config.scopes.get(name)

    layers: list[Layer] = []
    if inputs.defaults is not None:
        layers.append(inputs.defaults)
    layers.append(inputs.flat)
    if file is not None and file_scope is not None:
        fscope = file_scope
        pfile = file

        def scope_label(loc: Loc) -> str:
            return pfile.scope_key(fscope, loc)

        data, found = validate_layer(fscope.settings, SCOPE_COMMON, scope_label)
        invalid = invalid or bool(rejected_names(fscope.settings, data) & GUARD_FIELDS)
        problems.extend(found)
        layers.append(Layer(data, scope_label))
    if env_scope is not None:
        problems.extend(env_scope.problems)
        escope = env_scope

        def env_label(loc: Loc) -> str:
            return escope.keys.get(loc) or f"{name}__" + "__".join(str(p).upper() for p in loc)

        data, found = validate_layer(env_scope.settings, SCOPE_COMMON, env_label)
        problems.extend(found)
        invalid = invalid or bool(rejected_names(env_scope.settings, data) & GUARD_FIELDS)
        layers.append(Layer(data, env_label))

    resolved = resolve_layers(layers)
    flat_index = 1 if inputs.defaults is not None else 0
    options = components.resolve(name, layers, flat_index, resolved, inputs.registry, inputs.env)
    problems.extend(options.problems)
    resolved = options.resolved
    drafts, found = source_drafts(name, resolved, file, file_scope, env_scope, inputs.env)
    problems.extend(found)
    invalid = invalid or any(draft.rejected & GUARD_FIELDS for draft in drafts)

    sources: list[SourceConfig] = []
    for draft in drafts:
        source, found = build_source(name, draft, call_kind)
        problems.extend(found)
        if source is not None:
            sources.append(source)

    scope, found = _build_scope_settings(name, resolved, tuple(sources), options.models)
    problems.extend(found)
    if scope is None:
        return None, problems
    problems.extend(
        health_probe_problems(scope, call_kind, resolved.keys.get(("breaker", "health_probe")))
    )
    if not invalid:
        # Guards on defaults standing in for rejected values would only add noise.
        written = WrittenKeys(
            sources={
                (draft.name, str(loc[0])): key
                for draft in drafts
                for loc, key in draft.keys.items()
                if len(loc) == 1
            },
            scope={tuple(map(str, loc)): key for loc, key in resolved.keys.items()},
        )
        problems.extend(check_guards(scope, written))
    if registry is not None:
        chosen_by = {
            kind: resolved.keys[path]
            for kind, path in REGISTRY_CHOICES.items()
            if path in resolved.keys
        }
        problems.extend(scope_registry_problems(scope, registry, chosen_by, call_kind=call_kind))
    return (None if problems else scope), problems


def _build_scope_settings(
    name: str,
    resolved: Resolved,
    sources: tuple[SourceConfig, ...],
    models: Mapping[Loc, Any],
) -> tuple[ScopeSettings | None, list[str]]:
    problems: list[str] = []
    values = resolved.values

    def options(path: Loc) -> Any:
        # The validated model instance when the component has one, else the raw mapping.
        found = models.get(path)
        return found if found is not None else MaskedOptions(get_path(values, path) or {})

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
            for k in (
                "fail_threshold",
                "cooldown_s",
                "probe_ttl_s",
                "max_cooldown_s",
                "health_probe",
            )
            if k in breaker_table
        }
    )
    if breaker.max_cooldown_s is not None and breaker.max_cooldown_s < breaker.cooldown_s:
        key = resolved.keys.get(("breaker", "max_cooldown_s"), f"{name}__BREAKER__MAX_COOLDOWN_S")
        problems.append(
            f"{key}: max_cooldown_s {breaker.max_cooldown_s:g} must be >= cooldown_s "
            f"{breaker.cooldown_s:g}"
        )
    limiter_table = resolved.table("limiter")
    limiter = ComponentChoice(
        str(limiter_table.get("name", DEFAULT_BACKEND)), options(("limiter", "options"))
    )
    breaker_backend = ComponentChoice(
        str(breaker_table.get("backend", DEFAULT_BACKEND)), options(("breaker", "options"))
    )

    cache, found = _cache_settings(name, resolved, options(("cache", "options")))
    problems.extend(found)
    problems.extend(fanout_problems(name, resolved))
    telemetry = _telemetry_settings(resolved, options)

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
        layer: options(("middleware_options", layer))
        for layer in resolved.table("middleware_options")
    }
    # A layer with a model has options even when none were written (its defaults).
    middleware_options.update(
        {str(path[1]): model for path, model in models.items() if path[0] == "middleware_options"}
    )

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


def _cache_settings(name: str, resolved: Resolved, options: Any) -> tuple[CacheSettings, list[str]]:
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
        options=options,
    )
    return cache, problems


def _telemetry_settings(resolved: Resolved, options: Callable[[Loc], Any]) -> TelemetrySettings:
    table = resolved.table("telemetry")
    kwargs: dict[str, Any] = {}
    path: Loc = ("telemetry", "options")
    if "backend" in table:
        names = backend_names(table["backend"])
        kwargs["backend"] = ",".join(names) or NO_BACKEND
        if len(names) > 1:  # a fan-out: each backend's options under its name
            fanned = {name: options((*path, name)) for name in names if name != NO_BACKEND}
            return TelemetrySettings(options=fanned, **_telemetry_fields(table, kwargs))
    return TelemetrySettings(options=options(path), **_telemetry_fields(table, kwargs))


def _telemetry_fields(table: Mapping[str, Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    if "sqlite_path" in table:
        kwargs["sqlite_path"] = str(table["sqlite_path"])
    if "content" in table:
        kwargs["content"] = table["content"]
    return kwargs
