"""THE telemetry row builder, for every call kind (ARCHITECTURE §7.8; the single-helper rule).

One attempt, cache hit or call refused before any attempt is one ``TelemetryRecord``. Rows of
every call kind are built here, so the 18 fields mean the same thing everywhere; kinds differ
only in what ``messages`` (the request) and ``response`` (the answer) summarise:

- chat: the canonical messages JSON (multimodal parts digested) and the completion text;
- embeddings, OCR (written by their clients): e.g. a JSON list of input digests and a short
  description of the result (``"3 vectors x 1024"``, the recognised text).

A successful outcome is anything with the attributes of ``RowSummary``: ``LLMResponse`` has
them; other call kinds pass an ``AttemptSummary``. A failed one is the exception.

``RowWriter`` hands rows to a recorder without awaiting (``record_nowait`` when the recorder
has it, a task per row otherwise, ``drain()`` to wait for those) and never raises into a call;
``AttemptRows`` is the governor observer that writes one row per attempt of one call. The
chat telemetry layer writes through them too.

Every row of one call carries the same ``root_call_id`` (``CallRoot``: the ``call_id`` of the
call's first row), so a reader counts calls, and calls whose every attempt failed, apart from
attempts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from polygateway.frozen import value_methods
from polygateway.ids import new_call_id
from polygateway.ports import (
    CallTrace,
    Clock,
    DeclaresContentUse,
    Pricing,
    SupportsCallTraces,
    SupportsRecordNowait,
    TelemetryRecorder,
)
from polygateway.settings import SourceConfig, TelemetryContent
from polygateway.types import (
    CallStart,
    GovernanceEvent,
    TelemetryRecord,
    UsageSource,
)

__all__ = [
    "CANCELLED",
    "AttemptRows",
    "AttemptSummary",
    "CallRoot",
    "RowSummary",
    "RowWriter",
    "build_record",
    "error_name",
    "outcome_cost",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

CANCELLED = "cancelled"
"""The ``error`` of a row whose attempt (or call) was cancelled."""


class RowSummary(Protocol):
    """What a row reads of a successful outcome (``LLMResponse`` and ``AttemptSummary``)."""

    @property
    def content(self) -> str:
        """The ``response`` column."""
        ...

    @property
    def thinking(self) -> str: ...

    @property
    def model(self) -> str: ...

    @property
    def provider(self) -> str: ...

    @property
    def source_name(self) -> str: ...

    @property
    def prompt_tokens(self) -> int: ...

    @property
    def completion_tokens(self) -> int: ...

    @property
    def usage_source(self) -> UsageSource: ...

    @property
    def latency_ms(self) -> int | None:
        """The attempt's own latency; ``None`` leaves the row the governor's measure."""
        ...

    @property
    def ttft_ms(self) -> float | None: ...

    @property
    def max_inter_token_ms(self) -> float | None: ...

    @property
    def cache_hit(self) -> bool: ...

    @property
    def cached_prompt_tokens(self) -> int:
        """Prompt tokens read from the provider's prompt cache (part of ``prompt_tokens``)."""
        ...

    @property
    def cache_write_tokens(self) -> int:
        """Prompt tokens written to the provider's prompt cache (part of ``prompt_tokens``)."""
        ...


@value_methods
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class AttemptSummary:
    """A ``RowSummary`` for call kinds without an ``LLMResponse`` (embeddings, OCR, ...).

    Empty ``model``/``provider``/``source_name`` fall back to the attempt's source; a
    ``latency_ms`` of ``None`` to the latency the governor measured.
    """

    content: str = ""
    model: str = ""
    provider: str = ""
    source_name: str = ""
    thinking: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    usage_source: UsageSource = "measured"
    latency_ms: int | None = None
    ttft_ms: float | None = None
    max_inter_token_ms: float | None = None
    cache_hit: bool = False
    cached_prompt_tokens: int = 0
    cache_write_tokens: int = 0


class CallRoot:
    """The ``root_call_id`` of one call's rows: the ``call_id`` of its first row.

    Make one per call and hand it to every row builder of that call (``AttemptRows`` makes its
    own: one governed run is one call).
    """

    __slots__ = ("call_id",)

    def __init__(self) -> None:
        self.call_id = ""

    def of(self, call_id: str) -> str:
        """The root for a row ``call_id``: the first id asked about becomes the root."""
        if not self.call_id:
            self.call_id = call_id
        return self.call_id

    def __repr__(self) -> str:
        return f"CallRoot({self.call_id!r})"


def error_name(outcome: BaseException) -> str:
    """The ``error`` column: the exception class name, or ``"cancelled"``."""
    if isinstance(outcome, asyncio.CancelledError):
        return CANCELLED
    return type(outcome).__name__


def outcome_cost(outcome: RowSummary, model: str, pricing: Pricing | None) -> float | None:
    """``0.0`` for a cache hit; else ``pricing.cost`` of ``model`` (cache-aware when the
    outcome carries cached/written prompt tokens); ``None`` without pricing or model."""
    if outcome.cache_hit:
        return 0.0
    if pricing is None or not model:
        return None
    cached, written = outcome.cached_prompt_tokens, outcome.cache_write_tokens
    if cached or written:
        return pricing.cost(
            model,
            outcome.prompt_tokens,
            outcome.completion_tokens,
            cached_tokens=cached,
            cache_write_tokens=written,
        )
    # The usual call: pricing implementations without cache rates still work.
    return pricing.cost(model, outcome.prompt_tokens, outcome.completion_tokens)


def build_record(
    outcome: RowSummary | BaseException,
    *,
    call_id: str,
    parent_call_id: str | None,
    session_id: str | None,
    messages: str,
    latency_ms: int,
    created_at: float,
    pricing: Pricing | None = None,
    source: SourceConfig | None = None,
    scope: str = "",
    cache_namespace: str = "",
    params: str = "",
    root_call_id: str = "",
) -> TelemetryRecord:
    """One row from what became of one attempt (or cache hit, or refused call).

    ``scope`` defaults to the source's; ``cache_namespace`` and ``params`` (the request's
    generation parameters as canonical JSON) are the call's; ``root_call_id`` (default: this
    row's ``call_id``, a call of one row) names the call the attempt belongs to.

    ``source`` is the source the attempt went to (``None`` for cache hits and for errors
    raised before any attempt); ``messages`` is the request's summary. Cost: ``0.0`` for a
    cache hit; otherwise ``pricing.cost`` of the source's configured model (``None`` without
    pricing, for an unknown model, or when no model is known).
    """
    source_model = source.model if source is not None else ""
    if not isinstance(outcome, BaseException):
        model = outcome.model or source_model
        prompt_tokens = outcome.prompt_tokens
        completion_tokens = outcome.completion_tokens
        cache_hit = outcome.cache_hit
        cost = outcome_cost(outcome, source_model or model, pricing)
        # Positional, in field order (keywords cost a third more on this per-attempt path).
        return TelemetryRecord(
            call_id,
            parent_call_id,
            session_id,
            model,
            outcome.provider or (source.provider if source is not None else ""),  # provider
            outcome.source_name or (source.name if source is not None else ""),  # source_name
            messages,
            outcome.content,  # response
            outcome.thinking,
            prompt_tokens,
            completion_tokens,
            outcome.usage_source,
            # latency_ms: the outcome's own, so the row and what the caller saw agree.
            # (0 is a measure too: a call under a millisecond.)
            0 if cache_hit else (latency_ms if outcome.latency_ms is None else outcome.latency_ms),
            None if cache_hit else outcome.ttft_ms,
            None if cache_hit else outcome.max_inter_token_ms,
            cache_hit,
            None,  # error
            cost,
            created_at,
            scope or (source.scope if source is not None else ""),
            cache_namespace,
            params,
            root_call_id or call_id,
        )
    # A failed attempt: the upstream's usage is unknown, so tokens are 0 and marked estimated.
    return TelemetryRecord(
        call_id=call_id,
        parent_call_id=parent_call_id,
        session_id=session_id,
        model=source_model,
        provider=source.provider if source is not None else "",
        source_name=source.name if source is not None else "",
        messages=messages,
        response="",
        thinking="",
        prompt_tokens=0,
        completion_tokens=0,
        usage_source="estimated",
        latency_ms=latency_ms,
        ttft_ms=None,
        max_inter_token_ms=None,
        cache_hit=False,
        error=error_name(outcome),
        cost=pricing.cost(source_model, 0, 0) if pricing is not None and source_model else None,
        created_at=created_at,
        scope=scope or (source.scope if source is not None else ""),
        cache_namespace=cache_namespace,
        params=params,
        root_call_id=root_call_id or call_id,
    )


def _digest(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest() if text else ""


def with_content(record: TelemetryRecord, content: TelemetryContent) -> TelemetryRecord:
    """The row as ``PGW_TELEMETRY_CONTENT`` wants it kept: prompt, answer and thinking as
    ``sha256:<hex>`` digests (equal texts stay recognisable, nothing readable is stored) or
    empty; every other field unchanged."""
    if content == "full":
        return record
    if content == "digest":
        return dataclasses.replace(
            record,
            messages=_digest(record.messages),
            response=_digest(record.response),
            thinking=_digest(record.thinking),
        )
    return dataclasses.replace(record, messages="", response="", thinking="")


class RowWriter:
    """Builds rows with its clock and pricing and hands them to a recorder, never awaiting.

    Recorders that implement ``ports.SupportsRecordNowait`` (the builtin ones) get each row
    synchronously; others get a task per row, which ``drain()`` waits for (await it before the
    recorder's ``flush`` on shutdown). Nothing here raises into a call: a row that cannot be
    built or recorded is a warning, once per cause.
    """

    __slots__ = (
        "_clock",
        "_content",
        "_open_call",
        "_pricing",
        "_recorder",
        "_submit",
        "_tasks",
        "_wants_content",
        "_warned",
    )

    def __init__(
        self,
        recorder: TelemetryRecorder,
        *,
        clock: Clock,
        pricing: Pricing | None = None,
        content: TelemetryContent = "full",
    ) -> None:
        self._recorder = recorder
        self._content = content
        self._clock = clock
        self._pricing = pricing
        self._warned: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        # Checked once: recorders that enqueue synchronously skip a task per row.
        self._submit: Callable[[TelemetryRecord], None] = (
            recorder.record_nowait
            if isinstance(recorder, SupportsRecordNowait)
            else self._submit_as_task
        )
        self._open_call: Callable[[CallStart], CallTrace] | None = (
            recorder.open_call if isinstance(recorder, SupportsCallTraces) else None
        )
        self._wants_content = (
            recorder.wants_content if isinstance(recorder, DeclaresContentUse) else True
        )

    @property
    def recorder(self) -> TelemetryRecorder:
        return self._recorder

    @property
    def pricing(self) -> Pricing | None:
        return self._pricing

    def build(
        self,
        outcome: RowSummary | BaseException,
        *,
        call_id: str,
        parent_call_id: str | None,
        session_id: str | None,
        messages: str,
        latency_ms: int,
        source: SourceConfig | None = None,
        scope: str = "",
        cache_namespace: str = "",
        params: str = "",
        root_call_id: str = "",
    ) -> TelemetryRecord | None:
        """``build_record`` stamped with this writer's clock and pricing; ``None`` (and a
        warning) when the row cannot be built."""
        try:
            record = build_record(
                outcome,
                call_id=call_id,
                parent_call_id=parent_call_id,
                session_id=session_id,
                messages=messages,
                latency_ms=latency_ms,
                created_at=self._clock.time(),
                pricing=self._pricing,
                source=source,
                scope=scope,
                cache_namespace=cache_namespace,
                params=params,
                root_call_id=root_call_id,
            )
            if self._content == "full":
                return record
            # A recorder that reads no content still holds the row (in a queue): the policy
            # applies. Empty is as strict as a digest for it and costs no hashing.
            return with_content(record, self._content if self._wants_content else "none")
        except Exception as exc:  # noqa: BLE001 - telemetry must never break the call
            self.warn_once("build", "telemetry row could not be built: %r", exc)
            return None

    def submit(self, record: TelemetryRecord) -> None:
        """Hand a row to the recorder without awaiting; never raises."""
        try:
            self._submit(record)
        except Exception as exc:  # noqa: BLE001 - a failing recorder degrades to a warning
            self.warn_once(f"record:{type(exc).__name__}", "telemetry recorder failed: %r", exc)

    def write(
        self,
        outcome: RowSummary | BaseException,
        *,
        call_id: str,
        parent_call_id: str | None,
        session_id: str | None,
        messages: str,
        latency_ms: int,
        source: SourceConfig | None = None,
        scope: str = "",
        cache_namespace: str = "",
        params: str = "",
        root_call_id: str = "",
    ) -> TelemetryRecord | None:
        """``build`` then ``submit``; the row written, or ``None``."""
        record = self.build(
            outcome,
            call_id=call_id,
            parent_call_id=parent_call_id,
            session_id=session_id,
            messages=messages,
            latency_ms=latency_ms,
            source=source,
            scope=scope,
            cache_namespace=cache_namespace,
            params=params,
            root_call_id=root_call_id,
        )
        if record is not None:
            self.submit(record)
        return record

    @property
    def wants_content(self) -> bool:
        """The recorder reads the rows' content (``ports.DeclaresContentUse``); when not,
        callers may pass ``messages=""`` and the row keeps its other fields as built."""
        return self._wants_content

    @property
    def traces_calls(self) -> bool:
        """The recorder takes whole calls (``ports.SupportsCallTraces``)."""
        return self._open_call is not None

    def open_call(self, start: CallStart) -> CallTrace | None:
        """The recorder's ``CallTrace`` for a call starting now (call it in the caller's
        task), or ``None`` when it takes rows one by one or could not open one."""
        opener = self._open_call
        if opener is None:
            return None
        try:
            return opener(start)
        except Exception as exc:  # noqa: BLE001 - the rows then go one by one
            self.warn_once("open_call", "telemetry recorder could not open a call: %r", exc)
            return None

    def submit_attempt(
        self, trace: CallTrace | None, record: TelemetryRecord, outcome: object
    ) -> None:
        """Hand a row to ``trace`` (with the outcome it was built from), or to the recorder
        when there is no trace; never raises."""
        if trace is None:
            self.submit(record)
            return
        try:
            trace.attempt(record, outcome)
        except Exception as exc:  # noqa: BLE001 - a failing recorder degrades to a warning
            self.warn_once(f"trace:{type(exc).__name__}", "telemetry call trace failed: %r", exc)

    def close_call(self, trace: CallTrace | None, error: BaseException | None) -> None:
        """End ``trace`` (stamped with this writer's clock); never raises."""
        if trace is None:
            return
        try:
            trace.close(self._clock.time(), error)
        except Exception as exc:  # noqa: BLE001 - a failing recorder degrades to a warning
            self.warn_once(f"trace:{type(exc).__name__}", "telemetry call trace failed: %r", exc)

    def call_start(
        self,
        operation: str,
        *,
        scope: str = "",
        session_id: str | None = None,
        parent_call_id: str | None = None,
        cache_namespace: str = "",
        stream: bool = False,
    ) -> CallStart:
        """A ``CallStart`` stamped with this writer's clock."""
        return CallStart(
            operation,
            self._clock.time(),
            scope,
            session_id,
            parent_call_id,
            cache_namespace,
            stream,
        )

    async def drain(self) -> None:
        """Wait until every row handed over as a task (no ``record_nowait``) is recorded."""
        while self._tasks:
            await asyncio.gather(*tuple(self._tasks), return_exceptions=True)

    def warn_once(self, cause: str, message: str, *args: Any) -> None:
        """Log ``message`` at warning level the first time ``cause`` happens."""
        if cause in self._warned:
            return
        self._warned.add(cause)
        logger.warning(message, *args)

    def _submit_as_task(self, record: TelemetryRecord) -> None:
        task = asyncio.get_running_loop().create_task(self._record(record))
        self._tasks.add(task)  # a strong reference until done, or the task may vanish
        task.add_done_callback(self._tasks.discard)

    async def _record(self, record: TelemetryRecord) -> None:
        try:
            await self._recorder.record(record)
        except Exception as exc:  # noqa: BLE001 - a failing recorder degrades to a warning
            self.warn_once(f"record:{type(exc).__name__}", "telemetry recorder failed: %r", exc)

    def __repr__(self) -> str:
        return f"RowWriter(recorder={self._recorder!r}, pricing={self._pricing!r})"


class AttemptRows(Generic[T]):
    """A ``governance.AttemptObserver`` writing one row per attempt of one call, any kind.

    ``summarise`` turns the call kind's value into what the row says of it (an
    ``AttemptSummary``); ``messages`` is the request's summary, the same on every row of the
    call. Make one per call: ``governor.run(attempt, observer=AttemptRows(writer, ...))``.
    ``root`` is the call's ``CallRoot`` (its own by default: the first attempt's ``call_id``).
    A call that ends before any attempt (no quota, every breaker open, cancelled while waiting)
    still leaves its row: ``no_attempt(exc, latency_ms=...)`` when ``attempts`` is 0.

    With ``operation`` (the call kind: ``embeddings``, ``ocr``) it also opens the call for a
    recorder that takes whole calls (``ports.SupportsCallTraces``): make it in the caller's
    task when the call starts, pass ``events=rows.events`` to ``governor.run`` and call
    ``close(error)`` when the call ends.
    """

    __slots__ = (
        "_messages",
        "_parent_call_id",
        "_session_id",
        "_summarise",
        "_trace",
        "_writer",
        "attempts",
        "root",
    )

    def __init__(
        self,
        writer: RowWriter,
        *,
        messages: str,
        summarise: Callable[[T], RowSummary],
        parent_call_id: str | None = None,
        session_id: str | None = None,
        root: CallRoot | None = None,
        operation: str | None = None,
    ) -> None:
        self._writer = writer
        self._messages = messages
        self._summarise = summarise
        self._parent_call_id = parent_call_id
        self._session_id = session_id
        self.root = CallRoot() if root is None else root
        self.attempts = 0
        """Attempts observed so far."""
        self._trace = (
            writer.open_call(
                writer.call_start(operation, session_id=session_id, parent_call_id=parent_call_id)
            )
            if operation is not None
            else None
        )

    @property
    def events(self) -> Callable[[GovernanceEvent], None] | None:
        """The open call's listener of the governor's decisions (``Governor.run(events=)``),
        when its recorder wants them."""
        listener: Callable[[GovernanceEvent], None] | None = getattr(
            self._trace, "on_governance", None
        )
        return listener

    def close(self, error: BaseException | None) -> None:
        """End the open call (nothing without ``operation``); never raises."""
        self._writer.close_call(self._trace, error)

    def on_attempt(
        self, source: SourceConfig, call_id: str, outcome: T | BaseException, latency_ms: int
    ) -> None:
        self.attempts += 1
        if isinstance(outcome, BaseException):
            summary: RowSummary | BaseException = outcome
        else:
            try:
                summary = self._summarise(outcome)
            except Exception as exc:  # noqa: BLE001 - telemetry must never break the call
                self._writer.warn_once("summarise", "attempt could not be summarised: %r", exc)
                return
        self._write(summary, call_id, latency_ms, source)

    def no_attempt(self, error: BaseException, *, latency_ms: int) -> None:
        """The row of a call that ended before any attempt (no source named on it)."""
        self._write(error, new_call_id(), latency_ms, None)

    def _write(
        self,
        outcome: RowSummary | BaseException,
        call_id: str,
        latency_ms: int,
        source: SourceConfig | None,
    ) -> None:
        writer = self._writer
        record = writer.build(
            outcome,
            call_id=call_id,
            parent_call_id=self._parent_call_id,
            session_id=self._session_id,
            messages=self._messages,
            latency_ms=latency_ms,
            source=source,
            root_call_id=self.root.of(call_id),
        )
        if record is not None:
            writer.submit_attempt(self._trace, record, outcome)
