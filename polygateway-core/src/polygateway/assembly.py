"""Assembly: settings + registry -> the middleware onion, built once (the composition root).

Every part is resolved by its registered name (``registry.get(kind, name)``) unless it was
injected; then the middleware chain is composed from ``settings.middleware`` (outer -> inner).
Requests never pass through pluggy or this module: the result is a plain async callable.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from polygateway.errors import ConfigError
from polygateway.middleware import PassThroughMiddleware, cache_problems
from polygateway.ports import (
    CacheBackend,
    Clock,
    ComponentContext,
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
from polygateway.types import ChatRequest, LLMResponse

if TYPE_CHECKING:
    from polygateway.plugins import Registry

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


async def _retry_is_innermost(request: ChatRequest) -> LLMResponse:
    # The retry layer never calls call_next; reaching this means the chain was built wrongly.
    raise RuntimeError("the retry layer must be the innermost middleware")


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
    """The active layers, outer first (switched-off ones are already dropped)."""


def build_pipeline(
    settings: ScopeSettings,
    registry: Registry,
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
    # middleware order (retry present and last, no repeats).
    problems = list(check_guards(settings))
    problems.extend(unknown_middleware(settings.middleware, registry.names("middleware")))
    cache_on = _enabled("cache", settings.cache.backend, settings, cache)
    if cache_on and "cache" in settings.middleware:
        problems.extend(cache_problems(settings))
    if problems:
        raise ConfigError(problems)

    # Every part goes through ``registry.build``: options validated with the model its plugin
    # registered, the product checked against the kind's Protocol (a PluginError naming the
    # plugin, at startup rather than at the first call).
    def context(options: Any) -> ComponentContext[Any]:
        return ComponentContext(settings=settings, options=options, clock=clock)

    plain = context(MappingProxyType({}))
    if limiter is None:
        limiter = registry.build(
            "limiter", settings.limiter.name, context(settings.limiter.options)
        )
    if breaker is None:
        breaker = registry.build(
            "breaker", settings.breaker_backend.name, context(settings.breaker_backend.options)
        )
    if selector is None:
        selector = registry.build("selector", settings.selector, plain)
    strategy = registry.build("structured", settings.structured_strategy, plain)
    if cache is None and cache_on:
        cache = registry.build("cache", settings.cache.backend, context(settings.cache.options))
    if telemetry is None and _enabled("telemetry", settings.telemetry.backend, settings, telemetry):
        telemetry = registry.build(
            "telemetry", settings.telemetry.backend, context(settings.telemetry.options)
        )
    if pricing is None:
        # The table factory returns None when no pricing file is configured; a broken file
        # fails here, at startup.
        pricing = registry.build("pricing", "table", plain)
    providers: dict[str, ProviderProfile] = {
        name: registry.check("provider", name, registry.get("provider", name))
        for name in registry.names("provider")
    }
    built: dict[str, Transport] = {}
    for source in settings.sources:
        given = transports.get(source.name) if transports is not None else None
        built[source.name] = (
            given
            if given is not None
            else registry.build_transport(source.transport, source, providers)
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

    layers: list[Middleware] = []
    for name in settings.middleware:
        options = settings.middleware_options.get(name, {})
        ctx = ComponentContext(
            settings=settings, options=options, clock=clock, components=components
        )
        layer = registry.build("middleware", name, ctx)
        if not isinstance(layer, PassThroughMiddleware):
            layers.append(layer)

    handler: Handler = _retry_is_innermost
    for layer in reversed(layers):
        handler = _bind(layer, handler)
    return Pipeline(handler=handler, components=components, layers=tuple(layers))
