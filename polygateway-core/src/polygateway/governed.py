"""The parts of a governed client of a call kind other than chat (embeddings, OCR, ...).

Such a client says what one attempt is; everything around it is the same for every call kind
and lives here: one transport per source (the injected one or built from the call kind's
registry under the source's ``transport`` name), the limiter, breaker, selector, recorder and
pricing of ``polygateway.assembly.build_governance``, the telemetry ``RowWriter``, the
``Governor`` that runs the attempts, and closing what was built in the order of
``polygateway.lifecycle.close_client_parts``. ``load_kind_scope`` is the common part of such a
client's ``from_env``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import replace
from os import PathLike
from typing import Any

from polygateway.assembly import build_governance
from polygateway.clock import SystemClock
from polygateway.config.kinds import CallKind, health_probe_problems
from polygateway.errors import ConfigError, PluginError
from polygateway.governance import Attempt, Governor
from polygateway.lifecycle import close_client_parts
from polygateway.plugins import Registry
from polygateway.ports import (
    Clock,
    Pricing,
    ProviderGate,
    RateLimiter,
    SourceSelector,
    TelemetryRecorder,
)
from polygateway.records import RowWriter
from polygateway.settings import ScopeSettings, SourceConfig

__all__ = ["GovernedParts", "load_kind_scope"]

_CHAT_DEFAULT_TRANSPORT = SourceConfig.__dataclass_fields__["transport"].default
"""What ``SourceConfig.transport`` says when a source names no transport."""


class GovernedParts:
    """Everything a governed client of ``transport_kind`` needs but its attempt.

    Parts given as arguments (``limiter``, ``breaker``, ``selector``, ``telemetry``,
    ``pricing``, ``transports`` by source name) are used as they are and stay the caller's;
    ``aclose()`` closes only what was built here and flushes the recorder.

    :param call_kind: the call kind served: its transports' registry kind
        (``embedding_transport``, ``ocr_transport``) and the transport of a source that names
        none (settings built by hand say the chat default then).
    :param adjust: settings that depend on the transports (e.g. lease TTLs sized on their
        longest deadline), applied before the governance parts are built.
    :param health_probe: the call kind's cheap request (``Governor``'s ``health_probe``),
        sent in the background to an open source when ``{SCOPE}__BREAKER__HEALTH_PROBE`` is on.
    :raises ConfigError: ``{SCOPE}__BREAKER__HEALTH_PROBE`` on without a ``health_probe``
        (the call kind's ``no_health_probe`` says why it has none).
    :raises PluginError: a transport name the registry does not know, naming the source's key.
    """

    __slots__ = (
        "_closed",
        "_owned",
        "_owns_telemetry",
        "breaker",
        "clock",
        "governor",
        "limiter",
        "pricing",
        "rows",
        "settings",
        "telemetry",
        "transports",
    )

    def __init__(
        self,
        settings: ScopeSettings,
        *,
        call_kind: CallKind,
        registry: Registry | None = None,
        clock: Clock | None = None,
        limiter: RateLimiter | None = None,
        breaker: ProviderGate | None = None,
        selector: SourceSelector | None = None,
        telemetry: TelemetryRecorder | None = None,
        pricing: Pricing | None = None,
        transports: Mapping[str, Any] | None = None,
        rng: random.Random | None = None,
        adjust: Callable[[ScopeSettings, Mapping[str, Any]], ScopeSettings] | None = None,
        health_probe: Attempt[Any] | None = None,
    ) -> None:
        if health_probe is None and settings.breaker.health_probe:
            # On but nothing to send: refused, not silently ignored.
            kind = call_kind
            if kind.no_health_probe is None:
                kind = replace(kind, no_health_probe="its client gives no cheap request to send")
            raise ConfigError(health_probe_problems(settings, kind))
        if registry is None:
            from polygateway.plugins import load_registry

            registry = load_registry()
        self.clock: Clock = clock if clock is not None else SystemClock()
        # What this client built and therefore closes, in closing order.
        owned: list[tuple[str, Any]] = []
        built: dict[str, Any] = {}
        for source in settings.sources:
            given = transports.get(source.name) if transports is not None else None
            if given is None:
                given = _build_transport(registry, call_kind, settings.scope, source)
                owned.append((f"transport {source.name!r}", given))
            built[source.name] = given
        if adjust is not None:
            settings = adjust(settings, built)
        parts = build_governance(
            settings,
            registry,
            clock=self.clock,
            limiter=limiter,
            breaker=breaker,
            selector=selector,
            telemetry=telemetry,
            pricing=pricing,
        )
        owned.extend(
            (name, getattr(parts, name)) for name in ("limiter", "breaker") if name in parts.built
        )
        self.settings: ScopeSettings = settings
        self.transports: Mapping[str, Any] = built
        self.limiter: RateLimiter = parts.limiter
        self.breaker: ProviderGate = parts.breaker
        self.telemetry: TelemetryRecorder | None = parts.telemetry
        self.pricing: Pricing | None = parts.pricing
        self._owns_telemetry = "telemetry" in parts.built
        self.rows: RowWriter | None = (
            RowWriter(parts.telemetry, clock=self.clock, pricing=parts.pricing)
            if parts.telemetry is not None
            else None
        )
        self._owned: tuple[tuple[str, Any], ...] = tuple(owned)
        self.governor = Governor(
            sources=settings.sources,
            limiter=parts.limiter,
            breaker=parts.breaker,
            selector=parts.selector,
            retry=settings.retry,
            breaker_settings=settings.breaker,
            backpressure=settings.backpressure,
            clock=self.clock,
            rng=rng,
            health_probe=health_probe,
            scope=settings.scope,
        )
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    async def aclose(self) -> None:
        """Close what was built here, hand over the rows in flight, flush (and close, when
        built here) the recorder. Idempotent."""
        if self._closed:
            return
        self._closed = True
        await close_client_parts(
            owned=self._owned,
            drains=() if self.rows is None else (self.rows.drain,),
            telemetry=self.telemetry,
            owns_telemetry=self._owns_telemetry,
        )


def _build_transport(
    registry: Registry, call_kind: CallKind, scope: str, source: SourceConfig
) -> Any:
    name = source.transport
    default = call_kind.default_transport
    if default is not None and name == _CHAT_DEFAULT_TRANSPORT:
        name = default
    try:
        return registry.build_source_port(call_kind.transport_kind, name, source)  # type: ignore[arg-type]
    except PluginError as exc:
        from polygateway.config.guards import source_key

        key = source_key(scope, source, "transport")
        raise PluginError([f"{key} (source {source.name}): {p}" for p in exc.problems]) from None


def load_kind_scope(
    scope: str,
    *,
    call_kind: CallKind,
    env: Mapping[str, str] | None = None,
    pipeline_path: str | PathLike[str] | None = None,
    dotenv_path: str | PathLike[str] | None = None,
    registry: Registry | None = None,
) -> tuple[ScopeSettings, Registry]:
    """The settings of ``scope`` from the environment, ``.env`` and the pipeline file (its
    sources read as ``call_kind`` says), and the registry: the one given,
    else the installed plugins ``PGW_PLUGINS`` lets in."""
    from polygateway.config import load_scope, plugin_filter

    if registry is None:
        from polygateway.plugins import load_registry

        registry = load_registry(allowed=plugin_filter(env, dotenv_path=dotenv_path))
    settings = load_scope(
        scope,
        env,
        pipeline_path=pipeline_path,
        dotenv_path=dotenv_path,
        registry=registry,
        call_kind=call_kind,
    )
    return settings, registry
