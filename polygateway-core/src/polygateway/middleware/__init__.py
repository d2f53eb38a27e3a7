"""The builtin middleware layers and their factories (registered under kind ``middleware``).

Middleware are the wrapping layers only (telemetry, cache, structured, plugin layers), in the
order the pipeline file gives; the governed chat dispatcher (``polygateway.chat``) is not a
layer: assembly pins it innermost.

Each factory takes a ``BuildContext`` whose ``components`` are set and returns a
``ports.Middleware``. Implementation modules are imported inside the factories, so a layer
that is not in the pipeline is never imported.

A layer whose component is switched off (cache or telemetry backend ``none``) is built as a
``PassThroughMiddleware``; the assembly drops pass-through layers from the chain, so an
absent capability costs nothing per call.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable

from polygateway.errors import ConfigError
from polygateway.ports import BuildContext, Components, Handler, Middleware
from polygateway.settings import ScopeSettings
from polygateway.types import ChatRequest, LLMResponse

__all__ = [
    "RETRY_DEPRECATION",
    "PassThroughMiddleware",
    "builtin_layers",
    "cache_problems",
    "model_identity",
]

LayerFactory = Callable[[BuildContext], Middleware]


class PassThroughMiddleware:
    """A layer that does nothing (its capability is off); the assembly leaves it out."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    async def __call__(self, request: ChatRequest, call_next: Handler) -> LLMResponse:
        return await call_next(request)

    def __repr__(self) -> str:
        return f"PassThroughMiddleware({self.name!r})"


def model_identity(settings: ScopeSettings) -> str:
    """The scope's model identity for cache keys: its distinct source models, sorted, joined.

    Distinct, so that adding a second account of the same model keeps every cached entry.
    """
    return ",".join(sorted({source.model for source in settings.sources}))


def cache_problems(settings: ScopeSettings) -> list[str]:
    """What is missing for the response cache to run (ARCHITECTURE §7.5: namespace and TTL)."""
    cache = settings.cache
    problems: list[str] = []
    if not cache.namespace:
        problems.append(
            f"{settings.scope}: the response cache is on (backend {cache.backend!r}) but has no "
            "namespace: set PGW_CACHE_NAMESPACE (or cache.namespace in the pipeline file), or "
            "turn the cache off with PGW_CACHE_BACKEND=none"
        )
    ttl = cache.ttl_s
    if ttl is None or not ttl > 0:
        problems.append(
            f"{settings.scope}: the response cache needs a TTL > 0, got {ttl!r}: set "
            "PGW_CACHE_TTL_S (or cache.ttl_s in the pipeline file)"
        )
    return problems


def _components(ctx: BuildContext, layer: str) -> Components:
    if ctx.components is None:
        raise ConfigError(f"middleware {layer!r} was built without assembled components")
    return ctx.components


def _telemetry(ctx: BuildContext) -> Middleware:
    components = _components(ctx, "telemetry")
    if components.telemetry is None:
        if components.pricing is not None:  # no rows, but the caller still gets resp.cost
            from polygateway.middleware.telemetry import PricingMiddleware

            return PricingMiddleware(components.pricing, sources=ctx.settings.sources)
        return PassThroughMiddleware("telemetry")
    from polygateway.middleware.telemetry import TelemetryMiddleware

    return TelemetryMiddleware(
        components.telemetry,
        pricing=components.pricing,
        clock=ctx.clock,
        content=ctx.settings.telemetry.content,
        scope=ctx.settings.scope,
        namespace=ctx.settings.cache.namespace,
    )


def _cache(ctx: BuildContext) -> Middleware:
    components = _components(ctx, "cache")
    if components.cache is None:
        return PassThroughMiddleware("cache")
    problems = cache_problems(ctx.settings)
    namespace, ttl = ctx.settings.cache.namespace, ctx.settings.cache.ttl_s
    if problems or not namespace or ttl is None:
        raise ConfigError(problems)
    from polygateway.middleware.cache import CacheMiddleware

    return CacheMiddleware(
        components.cache,
        namespace=namespace,
        ttl_s=float(ttl),
        model_identity=model_identity(ctx.settings),
        strategy=components.strategy,
    )


def _structured(ctx: BuildContext) -> Middleware:
    components = _components(ctx, "structured")
    from polygateway.middleware.structured import StructuredMiddleware

    return StructuredMiddleware(
        components.strategy,
        providers=components.providers,
        sources=ctx.settings.sources,
        max_retries=ctx.settings.max_structured_retries,
    )


RETRY_DEPRECATION = (
    "{scope}: 'retry' in the middleware list is deprecated and ignored: the governed chat "
    "dispatcher is always the innermost handler; remove 'retry' from "
    "[scopes.{scope}].middleware"
)


def _retry(ctx: BuildContext) -> Middleware:
    # Pipeline files written before the dispatcher was pinned name "retry" (it had to be the
    # last layer): they keep working, with a warning, until the name is removed.
    warnings.warn(
        RETRY_DEPRECATION.format(scope=ctx.settings.scope),
        DeprecationWarning,
        stacklevel=_outside_stacklevel(),
    )
    return PassThroughMiddleware("retry")


def _outside_stacklevel() -> int:
    """The ``stacklevel`` of the first caller outside this library.

    Python shows a ``DeprecationWarning`` by default only when it is attributed to
    ``__main__``: attributed to the assembly it would never be seen.
    """
    level = 1
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_globals.get("__name__", "").startswith(
        "polygateway"
    ):
        frame = frame.f_back
        level += 1
    return level


def builtin_layers() -> dict[str, LayerFactory]:
    """Name -> factory of the core's layers, in their default order (outer -> inner).

    ``retry`` is only the deprecated name of old pipeline files (a pass-through, see above).
    """
    return {
        "telemetry": _telemetry,
        "cache": _cache,
        "structured": _structured,
        "retry": _retry,
    }
