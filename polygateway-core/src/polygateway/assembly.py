"""Assembly: settings + registry -> the middleware onion, built once (the composition root).

Every part is resolved by its registered name (``registry.get(kind, name)``) unless it was
injected; then the chat dispatcher (``polygateway.chat``: the governor over the sources' chat
transports) is pinned as the innermost handler and the wrapping layers of
``settings.middleware`` (outer -> inner) are composed around it. Requests never pass through
pluggy or this module: the result is a plain async callable.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from polygateway.chat.dispatcher import ChatDispatcher
from polygateway.errors import ConfigError
from polygateway.middleware import PassThroughMiddleware, cache_problems
from polygateway.ports import (
    BuildContext,
    CacheBackend,
    Clock,
    Components,
    Handler,
    Middleware,
    Pricing,
    ProviderGate,
    ProviderProfile,
    RateLimiter,
    SourceSelector,
    TelemetryRecorder,
    Transport,
)
from polygateway.settings import ScopeSettings
from polygateway.types import ChatRequest

__all__ = ["OFF", "build_pipeline", "unknown_middleware"]

OFF = "none"
"""The backend name that switches the cache or telemetry off."""


def unknown_middleware(names: Sequence[str], registered: Sequence[str]) -> list[str]:
    """Problems for middleware names no plugin registered (order is ``check_guards``' job)."""
    unknown = [name for name in names if name not in registered]
    if not unknown:
        return []
    known = ", ".join(registered) or "none"
    return [f"unknown middleware {unknown}; registered middleware: {known}"]


def _bind(layer: Middleware, inner: Handler) -> Handler:
    # A plain function returning the layer's coroutine: no extra coroutine frame per layer.
    def handler(request: ChatRequest) -> Any:
        return layer(request, inner)

    return handler


def _enabled(layer: str, backend: str, settings: ScopeSettings, injected: object) -> bool:
    return injected is not None or (layer in settings.middleware and backend != OFF)


@dataclass(frozen=True, slots=True)
class Pipeline:
    """What assembly produces for one scope."""

    handler: Handler
    components: Components
    layers: tuple[Middleware, ...]
    """The active wrapping layers, outer first (switched-off ones are already dropped)."""
    dispatcher: ChatDispatcher
    """The pinned innermost handler (its ``governor`` holds the per-source state)."""


def build_pipeline(
    settings: ScopeSettings,
    registry: Any,
    *,
    clock: Clock,
    limiter: RateLimiter | None = None,
    breaker: ProviderGate | None = None,
    cache: CacheBackend | None = None,
    telemetry: TelemetryRecorder | None = None,
    pricing: Pricing | None = None,
    transports: Mapping[str, Transport] | None = None,
    selector: SourceSelector | None = None,
) -> Pipeline:
    """Build the onion for one scope: the handler, the parts, the layers (outer first).

    ``registry`` is a ``polygateway.plugins.Registry``. Injected parts are used as given (and
    stay the caller's to close); ``transports`` may cover only some sources, the rest are
    built from each source's ``transport`` name. The cache and telemetry are built only when
    their layer is in ``settings.middleware`` and their backend is not ``none``.

    :raises ConfigError: no sources, a failed startup guard, a bad middleware list, a cache
        without namespace or TTL, or a name no plugin registered.
    """
    scope = settings.scope
    if not settings.sources:
        raise ConfigError(
            f"{scope}: no sources configured; set {scope}__<PROVIDER>__1__BASE_URL, "
            f"{scope}__<PROVIDER>__1__MODEL and {scope}__<PROVIDER>__1__API_KEY "
            "(or [[scopes.<scope>.sources]] in the pipeline file)"
        )

    # Everything that can be checked without building anything comes first.
    from polygateway.config import check_guards

    # check_guards covers the timeout chain, lease/probe TTLs, the stall window and the
    # middleware list (no repeats).
    problems = list(check_guards(settings))
    problems.extend(unknown_middleware(settings.middleware, registry.names("middleware")))
    cache_on = _enabled("cache", settings.cache.backend, settings, cache)
    if cache_on and "cache" in settings.middleware:
        problems.extend(cache_problems(settings))
    if problems:
        raise ConfigError(problems)

    def context(options: Mapping[str, Any]) -> BuildContext:
        return BuildContext(settings=settings, options=options, clock=clock)

    plain = context({})
    if limiter is None:
        factory = registry.get("limiter", settings.limiter.name)
        limiter = factory(context(settings.limiter.options))
    if breaker is None:
        factory = registry.get("breaker", settings.breaker_backend.name)
        breaker = factory(context(settings.breaker_backend.options))
    if selector is None:
        selector = registry.get("selector", settings.selector)(plain)
    strategy = registry.get("structured", settings.structured_strategy)(plain)
    if cache is None and cache_on:
        cache = registry.get("cache", settings.cache.backend)(context(settings.cache.options))
    if telemetry is None and _enabled("telemetry", settings.telemetry.backend, settings, telemetry):
        factory = registry.get("telemetry", settings.telemetry.backend)
        telemetry = factory(context(settings.telemetry.options))
    if pricing is None:
        # The table factory returns None when no pricing file is configured; a broken file
        # fails here, at startup.
        pricing = registry.get("pricing", "table")(plain)
    providers: dict[str, ProviderProfile] = {
        name: registry.get("provider", name) for name in registry.names("provider")
    }
    built: dict[str, Transport] = {}
    for source in settings.sources:
        given = transports.get(source.name) if transports is not None else None
        built[source.name] = (
            given
            if given is not None
            else registry.get("transport", source.transport)(source, providers)
        )

    components = Components(
        limiter=limiter,
        breaker=breaker,
        selector=selector,
        transports=built,
        providers=providers,
        strategy=strategy,
        cache=cache,
        telemetry=telemetry,
        pricing=pricing,
    )

    dispatcher = ChatDispatcher.create(
        sources=settings.sources,
        transports=built,
        limiter=limiter,
        breaker=breaker,
        selector=selector,
        retry=settings.retry,
        breaker_settings=settings.breaker,
        backpressure=settings.backpressure,
        clock=clock,
    )
    layers: list[Middleware] = []
    for name in settings.middleware:
        options = settings.middleware_options.get(name, {})
        ctx = BuildContext(settings=settings, options=options, clock=clock, components=components)
        layer = registry.get("middleware", name)(ctx)
        if not isinstance(layer, PassThroughMiddleware):
            layers.append(layer)

    handler: Handler = dispatcher
    for layer in reversed(layers):
        handler = _bind(layer, handler)
    return Pipeline(
        handler=handler, components=components, layers=tuple(layers), dispatcher=dispatcher
    )
