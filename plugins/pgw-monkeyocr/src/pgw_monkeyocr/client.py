"""``OcrClient``: governed OCR calls over the sources of one scope (default ``OCR``).

Every call runs on the core's ``polygateway.governance.Governor``, the same attempt loop chat
uses: source selection, cooldowns, the breaker, the limiter (global and per source, charged 0
tokens: OCR has no token billing), retries with backoff, switching, the stall verdict and
cancellation. The client only says what one attempt is (``transport.recognize_text(image)`` or
``transport.parse_layout(image)`` on the chosen source) and writes one telemetry row per attempt
with the core's row helpers (``polygateway.records.RowWriter`` / ``AttemptRows``): the
``messages`` column holds the image's digest (``sha256``, size, kind, pages), never its bytes;
``latency_ms`` the attempt's elapsed time. The limiter, breaker, selector and recorder come from
``polygateway.assembly.build_governance``, the transports from the ``ocr_transport`` registry.

Configuration (``from_env``): sources are ``{SCOPE}__{PROVIDER}__{N}__{FIELD}`` keys
(``OCR__MONKEY__1__BASE_URL=http://10.0.0.7:7861``, ``..._MAX_CONCURRENCY=1``,
``..._TIMEOUT_S``, ``..._TRUST_ENV``); ``MODEL`` is optional (default ``monkeyocr``: it only
names the model in telemetry). The transport's own options may be given as source keys too
(``OCR__MONKEY__1__MODE=split``, ``..._PER_PAGE_TIMEOUT_S``, ``..._MAX_ZIP_MB``; see
``ENV_OPTIONS``). Retry, breaker, backpressure, global limits, selector and the backends come
from the same keys as for chat (``OCR__RETRY__MAX_ATTEMPTS``, ``PGW_STATE_BACKEND``...).
A source's transport is the ``ocr_transport`` registered under its ``TRANSPORT`` name
(``monkeyocr`` when it names none).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import random
from collections.abc import Awaitable, Callable, Mapping
from os import PathLike
from typing import Any, Final, TypeVar

from polygateway.config import CallKind
from polygateway.errors import ConfigError
from polygateway.governance import Attempted, AttemptObserver, Governor
from polygateway.governed import GovernedParts, load_kind_scope
from polygateway.ids import elapsed_ms
from polygateway.plugins import Registry
from polygateway.ports import (
    Clock,
    OcrLayoutPort,
    OcrTextPort,
    ProviderGate,
    RateLimiter,
    SourceSelector,
    TelemetryRecorder,
)
from polygateway.records import AttemptRows, AttemptSummary
from polygateway.settings import BackpressureSettings, BreakerSettings, ScopeSettings, SourceConfig
from polygateway.types import OcrLayoutResult, OcrTextResult

from pgw_monkeyocr.sniff import describe_upload

logger = logging.getLogger(__name__)

DEFAULT_SCOPE: Final = "OCR"
DEFAULT_TRANSPORT: Final = "monkeyocr"
DEFAULT_MODEL: Final = "monkeyocr"
_DIGEST_IN_THREAD: Final = 1024 * 1024
"""Images larger than this are hashed off the event loop."""

ENV_OPTIONS: Final[dict[str, str]] = {
    "MODE": "mode",
    "RETURN_TYPE": "return_type",
    "PER_PAGE_TIMEOUT_S": "per_page_timeout_s",
    "PER_MB_TIMEOUT_S": "per_mb_timeout_s",
    "MAX_TIMEOUT_S": "max_timeout_s",
    "MAX_ZIP_MB": "max_zip_mb",
    "MAX_MEMBER_MB": "max_member_mb",
    "BBOX_TOLERANCE": "bbox_tolerance",
    "HEALTH_TIMEOUT_S": "health_timeout_s",
    "MAX_CONNECTIONS": "max_connections",
}
"""``{SCOPE}__{P}__{N}__{FIELD}`` source keys that set a transport option (``FIELD`` -> option)."""

OCR_CALLS: Final = CallKind(
    transport_kind="ocr_transport",
    default_transport=DEFAULT_TRANSPORT,
    default_model=DEFAULT_MODEL,
    source_options=ENV_OPTIONS,
    provider_profiles=False,
    no_health_probe=(
        "every OCR request runs the model over a whole image or document, so there is no cheap "
        "request to probe a source with"
    ),
)
"""How the loader reads an OCR scope: OCR transports (``monkeyocr`` when a source names none),
``MODEL`` optional, the transport's options as source keys, the provider only a family name;
``OCR__BREAKER__HEALTH_PROBE`` is refused (no cheap request)."""

R = TypeVar("R", OcrTextResult, OcrLayoutResult)


def _ocr_settings(settings: ScopeSettings, transports: Mapping[str, Any]) -> ScopeSettings:
    """Leases and probes must outlive the longest OCR call (the deadline grows with the input
    past ``timeout_s``): size them on each transport's ``max_deadline_s`` unless configured."""
    longest = max(
        (float(getattr(t, "max_deadline_s", 0.0)) for t in transports.values()),
        default=0.0,
    )
    longest = max(longest, settings.max_timeout_s)
    backpressure: BackpressureSettings = settings.backpressure
    breaker: BreakerSettings = settings.breaker
    if backpressure.lease_ttl_s is None:
        backpressure = dataclasses.replace(backpressure, lease_ttl_s=longest + 30.0)
    if breaker.probe_ttl_s is None:
        probe = max(2 * longest, breaker.cooldown_s, longest + 5.0)
        breaker = dataclasses.replace(breaker, probe_ttl_s=probe)
    return dataclasses.replace(settings, backpressure=backpressure, breaker=breaker)


def _summarise(result: OcrTextResult | OcrLayoutResult) -> AttemptSummary:
    """What a row says of a successful attempt (the transport's own elapsed time)."""
    return AttemptSummary(
        content=_describe(result),
        source_name=result.source_name,
        latency_ms=result.usage.elapsed_ms,
    )


def _describe(result: OcrTextResult | OcrLayoutResult) -> str:
    """The ``response`` column: the text, or a one-line summary of a layout."""
    if isinstance(result, OcrTextResult):
        return result.text
    return json.dumps(
        {
            "elements": len(result.elements),
            "pages": len(result.page_sizes),
            "bbox_issues": len(result.bbox_issues),
        },
        separators=(",", ":"),
    )


class OcrClient:
    """Governed ``recognize_text`` / ``parse_layout`` over the sources of one scope.

    Built by ``from_env`` / ``from_settings``; parts given as arguments (``limiter``,
    ``breaker``, ``selector``, ``telemetry``, ``transports``) are used as they are and stay the
    caller's to close. Close the client with ``aclose()`` (or ``async with``).
    """

    def __init__(
        self,
        settings: ScopeSettings,
        *,
        registry: Registry | None = None,
        clock: Clock | None = None,
        limiter: RateLimiter | None = None,
        breaker: ProviderGate | None = None,
        selector: SourceSelector | None = None,
        telemetry: TelemetryRecorder | None = None,
        transports: Mapping[str, Any] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        if not settings.sources:
            raise ConfigError(
                f"{settings.scope}: no OCR sources configured; set "
                f"{settings.scope}__MONKEY__1__BASE_URL"
            )
        parts = GovernedParts(
            settings,
            call_kind=OCR_CALLS,
            registry=registry,
            clock=clock,
            limiter=limiter,
            breaker=breaker,
            selector=selector,
            telemetry=telemetry,
            transports=transports,
            rng=rng,
            adjust=_ocr_settings,
        )
        self._parts = parts
        self._clock = parts.clock
        self._settings = parts.settings
        self._transports: Mapping[str, Any] = parts.transports
        self._rows = parts.rows
        self._governor = parts.governor

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_env(
        cls,
        scope: str = DEFAULT_SCOPE,
        *,
        env: Mapping[str, str] | None = None,
        pipeline_path: str | PathLike[str] | None = None,
        dotenv_path: str | PathLike[str] | None = None,
        **parts: Any,
    ) -> OcrClient:
        """The client of ``scope`` from the environment, ``.env`` and the pipeline file (``env``
        replaces ``os.environ``; ``parts`` as for the constructor)."""
        settings, parts["registry"] = load_kind_scope(
            scope.upper(),
            call_kind=OCR_CALLS,
            env=env,
            pipeline_path=pipeline_path,
            dotenv_path=dotenv_path,
            registry=parts.get("registry"),
        )
        return cls(settings, **parts)

    @classmethod
    def from_settings(cls, settings: ScopeSettings, **parts: Any) -> OcrClient:
        return cls(settings, **parts)

    # ------------------------------------------------------------------ calls

    async def recognize_text(
        self, image: bytes, *, session_id: str | None = None, parent_call_id: str | None = None
    ) -> OcrTextResult:
        """The text of ``image`` (PDF, PNG, JPEG) from whichever source the governor picks."""

        self._require(OcrTextPort, "recognize_text")

        def call(port: Any) -> Awaitable[OcrTextResult]:
            return port.recognize_text(image)  # type: ignore[no-any-return]

        return await self._run("text", image, call, session_id, parent_call_id)

    async def parse_layout(
        self, image: bytes, *, session_id: str | None = None, parent_call_id: str | None = None
    ) -> OcrLayoutResult:
        """Layout elements, page sizes and bbox issues of ``image``."""

        self._require(OcrLayoutPort, "parse_layout")

        def call(port: Any) -> Awaitable[OcrLayoutResult]:
            return port.parse_layout(image)  # type: ignore[no-any-return]

        return await self._run("layout", image, call, session_id, parent_call_id)

    def _require(self, port: type, method: str) -> None:
        lacking = sorted(n for n, t in self._transports.items() if not isinstance(t, port))
        if lacking:
            raise ConfigError(
                f"{self._settings.scope}: the transports of sources {lacking} have no {method}; "
                "give them a transport that does or leave them out of this scope"
            )

    async def _run(
        self,
        kind: str,
        image: bytes,
        call: Callable[[Any], Awaitable[R]],
        session_id: str | None,
        parent_call_id: str | None,
    ) -> R:
        if self._parts.closed:
            raise RuntimeError("this OcrClient is closed")
        upload = describe_upload(image)  # bad input is refused before any attempt
        digest = (
            await asyncio.to_thread(hashlib.sha256, image)
            if len(image) > _DIGEST_IN_THREAD
            else hashlib.sha256(image)
        )
        messages = json.dumps(
            {
                "ocr": kind,
                "image": f"sha256:{digest.hexdigest()}",
                "bytes": len(image),
                "kind": upload.kind,
                "pages": upload.pages,
            },
            separators=(",", ":"),
        )
        writer = self._rows
        observer: AttemptRows[R] | None = None
        if writer is not None:
            observer = AttemptRows(
                writer,
                messages=messages,
                summarise=_summarise,
                parent_call_id=parent_call_id,
                session_id=session_id,
                operation="ocr",
            )
        watcher: AttemptObserver[R] | None = observer
        transports = self._transports

        async def attempt(source: SourceConfig, call_id: str) -> Attempted[R]:
            return Attempted(await call(transports[source.name]), tokens=0)

        started = self._clock.monotonic()
        try:
            outcome = await self._governor.run(
                attempt,
                est_tokens=0,
                observer=watcher,
                events=observer.events if observer is not None else None,
            )
        except (Exception, asyncio.CancelledError) as exc:
            if observer is not None:
                # A call that never reached an attempt (no quota, breakers open, cancelled
                # while waiting) still leaves its row.
                if observer.attempts == 0:
                    observer.no_attempt(
                        exc, latency_ms=elapsed_ms(started, self._clock.monotonic())
                    )
                observer.close(exc)
            raise
        if observer is not None:
            observer.close(None)
        return outcome.value

    # ------------------------------------------------------------------ health, parts, lifecycle

    async def source_health(self) -> dict[str, bool]:
        """``check_health()`` of every source, concurrently (not governed: a probe)."""
        names = list(self._transports)
        answers = await asyncio.gather(*(self._transports[n].check_health() for n in names))
        return dict(zip(names, answers, strict=True))

    async def check_health(self) -> bool:
        """Whether at least one source is healthy (the client can serve)."""
        return any((await self.source_health()).values())

    @property
    def settings(self) -> ScopeSettings:
        return self._settings

    @property
    def governor(self) -> Governor:
        return self._governor

    @property
    def transports(self) -> Mapping[str, Any]:
        return self._transports

    @property
    def limiter(self) -> RateLimiter:
        return self._parts.limiter

    @property
    def breaker(self) -> ProviderGate:
        return self._parts.breaker

    async def __aenter__(self) -> OcrClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close what this client built and flush telemetry. Idempotent."""
        await self._parts.aclose()


__all__ = ["DEFAULT_MODEL", "DEFAULT_SCOPE", "DEFAULT_TRANSPORT", "ENV_OPTIONS", "OcrClient"]
