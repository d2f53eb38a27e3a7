"""Ports: the seams every implementation plugs into. Protocols only, nothing concrete.

Semantics that every backend must share are written here and enforced by the contract suites
in ``polygateway.testing.contracts``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import (
    TYPE_CHECKING,
    Any,
    Generic,
    Literal,
    Protocol,
    TypeAlias,
    TypeVar,
    runtime_checkable,
)

from polygateway.frozen import frozen_dataclass
from polygateway.settings import Limits, ScopeSettings, SourceConfig
from polygateway.types import (
    CallStart,
    ChatRequest,
    EmbeddingTransportResult,
    GovernanceEvent,
    LLMResponse,
    OcrLayoutResult,
    OcrTextResult,
    StreamDelta,
    TelemetryRecord,
    TelemetryValues,
    TransportResult,
)

if TYPE_CHECKING:
    from polygateway.options_ref import OptionsRef

# --------------------------------------------------------------------------- clock


@runtime_checkable
class Clock(Protocol):
    """Time source injected into every time-dependent component (deterministic tests)."""

    def monotonic(self) -> float:
        """Seconds on a monotonic scale (for deadlines, windows, cooldowns)."""
        ...

    def time(self) -> float:
        """Wall-clock seconds since the epoch (for telemetry timestamps)."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Sleep; a fake clock may advance itself instead of waiting."""
        ...


# --------------------------------------------------------------------------- pipeline

Handler: TypeAlias = Callable[[ChatRequest], Awaitable[LLMResponse]]
"""The inner part of the onion as seen by one layer."""


@runtime_checkable
class Middleware(Protocol):
    """One layer of the onion (starlette style): it may act before and after ``call_next``."""

    async def __call__(self, request: ChatRequest, call_next: Handler) -> LLMResponse: ...


@runtime_checkable
class CallObserver(Protocol):
    """Told about every attempt of a chat call; added to the call's ``CallContext`` by a layer
    (the telemetry layer adds one per call). Both methods are called synchronously and must
    not block; what they raise is logged and ignored."""

    def on_attempt(
        self,
        request: ChatRequest,
        source: SourceConfig,
        call_id: str,
        outcome: LLMResponse | BaseException,
        latency_ms: int,
    ) -> None:
        """Called once per attempt that reached the transport, success or not (incl. cancel)."""
        ...

    def on_result_invalid(self, call_id: str, error: BaseException) -> None:
        """A wrapping layer (the structured ladder) rejected the output of attempt ``call_id``
        after it was reported as a success."""
        ...


class DeltaSink(Protocol):
    """Receives the deltas of a streamed call as a transport parses them
    (``CallContext.stream``; set by ``GatewayClient.stream``). Synchronous, never blocks."""

    def on_delta(self, call_id: str, delta: StreamDelta) -> None: ...


@runtime_checkable
class Drainable(Protocol):
    """A layer that hands work to the background (telemetry rows) and can wait for it.

    The client awaits ``drain()`` of each such layer on ``aclose``, before flushing the
    recorder, so a graceful shutdown loses nothing. Checked once, at assembly.
    """

    async def drain(self) -> None: ...


@runtime_checkable
class StructuredOnly(Protocol):
    """Optional for a ``Middleware`` that hands every request with ``structured=None`` to
    ``call_next`` untouched (the structured layer): it says so with ``structured_only = True``.

    The assembly then calls such a layer only for structured requests, and sends the others
    straight to the next handler (checked per request, at the layer's place in the chain, so a
    layer further out that sets ``structured`` still reaches it): one coroutine less on every
    unstructured call. Checked once, at assembly.
    """

    structured_only: bool


# --------------------------------------------------------------------------- transports


@runtime_checkable
class Transport(Protocol):
    """Sends one attempt to one source: body assembly, streaming parse, error translation.

    Errors are translated into the four classes of ``polygateway.errors`` (ARCHITECTURE §6.2).
    No retry, no limits, no cache: those belong to middleware.
    """

    async def send(
        self, request: ChatRequest, source: SourceConfig, *, call_id: str
    ) -> TransportResult: ...

    async def aclose(self) -> None: ...


TransportFactory: TypeAlias = Callable[[SourceConfig, Mapping[str, "ProviderProfile"]], Transport]


@runtime_checkable
class EmbeddingTransport(Protocol):
    async def embed(
        self, *, texts: list[str], source: SourceConfig, call_id: str
    ) -> EmbeddingTransportResult: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class OcrTextPort(Protocol):
    async def recognize_text(self, image: bytes) -> OcrTextResult: ...

    async def check_health(self) -> bool: ...


@runtime_checkable
class OcrLayoutPort(Protocol):
    async def parse_layout(self, image: bytes) -> OcrLayoutResult: ...

    async def check_health(self) -> bool: ...


EmbeddingTransportFactory: TypeAlias = Callable[[SourceConfig], EmbeddingTransport]
"""What ``pgw_register_embedding_transports`` registers: one transport per source."""

OcrTransportFactory: TypeAlias = Callable[[SourceConfig], "OcrTextPort | OcrLayoutPort"]
"""What ``pgw_register_ocr_transports`` registers: one transport per source (text and/or
layout; it should also have ``aclose()``)."""


@runtime_checkable
class AudioPort(Protocol):
    """Placeholder (ARCHITECTURE D10): no implementation ships; the protocol shape is open."""

    async def transcribe(self, audio: bytes, *, mime_type: str) -> str: ...


# --------------------------------------------------------------------------- providers


ErrorVerdict: TypeAlias = Literal["source_dead", "transient", "rejected"]
"""What an error answer stands for: ``SourceDeadError``, ``TransientError``,
``RequestRejectedError`` (ARCHITECTURE §6.2)."""

ERROR_VERDICTS: tuple[str, ...] = ("source_dead", "transient", "rejected")


@frozen_dataclass(slots=True)
class ErrorRule:
    """One provider's error answer and the error class it stands for, as data (D11).

    A rule matches when every criterion it gives holds:

    - ``statuses``: the HTTP status is one of them. Empty: any status, and also an error event
      in a stream (or a 200 whose body is an error object), which has no status of its own.
    - ``codes``: the body's error ``code`` is one of them or, when the body carries no code, its
      ``type``. Compared as text: ``"1113"`` matches Zhipu's code whether sent as a string or an
      integer.
    - ``messages``: the error message contains one of them, ignoring case (a relay that drops
      the code usually keeps the provider's message).

    ``verdict`` is the class: ``"source_dead"`` (switch at once, breaker forced open),
    ``"transient"`` (retried with backoff) or ``"rejected"`` (raised at once, no switch, not
    counted). Rules are tried in order, a profile's before the common ones
    (``polygateway.transports.errors.COMMON_ERROR_RULES``); the first match wins, the status
    table decides when none matches. A rule without any criterion would match every error and
    is refused.
    """

    verdict: ErrorVerdict
    statuses: tuple[int, ...] = ()
    codes: tuple[str, ...] = ()
    messages: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.verdict not in ERROR_VERDICTS:
            raise ValueError(
                f"ErrorRule.verdict must be one of {ERROR_VERDICTS}, got {self.verdict!r}"
            )
        if not (self.statuses or self.codes or self.messages):
            raise ValueError("ErrorRule needs at least one of statuses, codes, messages")
        for status in self.statuses:
            if type(status) is not int or not 100 <= status <= 599:
                raise ValueError(f"ErrorRule.statuses must be HTTP statuses, got {status!r}")
        for name in ("codes", "messages"):
            values = getattr(self, name)
            if isinstance(values, str) or not all(isinstance(v, str) and v for v in values):
                raise ValueError(f"ErrorRule.{name} must be a tuple of non-empty strings")
        # Stored lower-cased: matching compares with the lower-cased message.
        object.__setattr__(self, "messages", tuple(m.lower() for m in self.messages))

    def matches(self, status: int | None, code: str | None, kind: str | None, lowered: str) -> bool:
        """Whether an error answer matches: its status (``None`` for a stream's error event),
        code and type (as text, ``None`` when absent) and its message, lower-cased."""
        if self.statuses and status not in self.statuses:
            return False
        if self.codes:
            key = code if code is not None else kind
            if key is None or key not in self.codes:
                return False
        return not self.messages or any(m in lowered for m in self.messages)


@frozen_dataclass(slots=True)
class ProviderProfile:
    """What differs between OpenAI-compatible providers (ARCHITECTURE D11), declared not guessed.

    ``thinking_body`` maps ``enable_thinking`` to the top-level body fields to merge
    (e.g. qwen ``{"enable_thinking": True}``, deepseek ``{"thinking": {"type": "enabled"}}``).
    ``error_rules``: this provider's error answers that the status alone misclassifies (e.g.
    DashScope's 400 ``Arrearage`` is an exhausted balance, not a bad request); tried before
    the common rules.
    """

    name: str
    thinking_body: Callable[[bool], Mapping[str, Any]] | None = None
    reasoning_fields: tuple[str, ...] = ("reasoning_content", "reasoning")
    think_tags: tuple[tuple[str, str], ...] = (("<think>", "</think>"),)
    supports_native_schema: bool = False
    thinking_requires_stream: bool = False
    error_rules: tuple[ErrorRule, ...] = ()
    max_tokens_field: str = "max_tokens"
    """The body field the per-call ``max_tokens`` is sent as (OpenAI: ``max_completion_tokens``)."""


# --------------------------------------------------------------------------- limiter


@frozen_dataclass
class Denial:
    """A refused admission: which gate said no and how long until it may say yes."""

    gate: Literal[
        "global_concurrency",
        "source_concurrency",
        "global_rpm",
        "source_rpm",
        "global_tpm",
        "source_tpm",
    ]
    wait_s: float


@runtime_checkable
class Permit(Protocol):
    """An admitted attempt. ``settle`` and ``release`` are idempotent; release runs in finally."""

    @property
    def lease_id(self) -> str: ...

    @property
    def source(self) -> str: ...

    @property
    def est_tokens(self) -> int: ...

    async def settle(self, actual_tokens: int) -> None:
        """Charge real usage: TPM of the acquire-time window moves by ``actual - est``."""
        ...

    async def release(self) -> None:
        """Free the concurrency lease. Never raises for backend trouble (warning instead)."""
        ...


@frozen_dataclass(slots=True)
class SourceStats:
    inflight: int
    rpm_used: int
    tpm_used: int


@runtime_checkable
class RateLimiter(Protocol):
    """Six gates, checked in order: global concurrency -> source concurrency -> global RPM ->
    source RPM -> global TPM -> source TPM. Concurrency and RPM refuse at ``used >= limit``;
    TPM refuses at ``used + est > limit``. A limit of 0 disables its gate. A refusal changes
    nothing. Leases expire after ``lease_ttl_s`` so a dead holder cannot leak them.

    Admission-side backend failures raise ``GovernanceBackendError``.
    """

    async def try_acquire(
        self, source: str, est_tokens: int, source_limits: Limits
    ) -> Permit | Denial: ...

    async def source_stats(self, source: str) -> SourceStats: ...

    async def inflight(self) -> int:
        """Leases currently held scope-wide (expired ones excluded)."""
        ...

    async def mark_progress(self) -> None:
        """Record "a call just completed" for the stall verdict (accounting side: warns)."""
        ...

    async def progress_age_s(self) -> float:
        """Seconds since the last progress mark; ``inf`` if never; never negative."""
        ...

    async def aclose(self) -> None: ...


# --------------------------------------------------------------------------- breaker

GateState: TypeAlias = Literal["closed", "open", "half_open"]


@frozen_dataclass
class GateDecision:
    """The answer of ``try_enter``. Write-backs quote it so stale epochs can be fenced."""

    source: str
    allowed: bool
    state: GateState
    epoch: int
    probe_owner: str | None = None
    retry_after_s: float = 0.0

    @property
    def is_probe(self) -> bool:
        return self.probe_owner is not None


@frozen_dataclass
class GateUpdate:
    """The result of a write-back. ``applied=False`` means the decision was stale (fenced)."""

    source: str
    applied: bool
    state: GateState
    epoch: int
    failures: int


@runtime_checkable
class ProviderGate(Protocol):
    """Per-source circuit breaker: closed -> (threshold failures) -> open (cooldown) ->
    half_open (exactly one probe, leased for ``probe_ttl_s``) -> closed on success / open on
    failure. The epoch increments only when entering OPEN; write-backs carrying an older epoch
    (or a probe owner that no longer holds the probe) are not applied.
    """

    async def try_enter(self, source: str) -> GateDecision: ...

    async def record_success(self, decision: GateDecision) -> GateUpdate: ...

    async def record_failure(
        self, decision: GateDecision, *, threshold: int | None = None, force_open: bool = False
    ) -> GateUpdate:
        """Count a failure; ``force_open`` (and a failed probe) jumps straight to threshold."""
        ...

    async def release_probe(self, decision: GateDecision) -> None:
        """Hand the probe back without a verdict (cancellation): the next caller probes at once."""
        ...

    async def force_open(self, source: str) -> GateUpdate: ...

    async def state(self, source: str) -> GateState: ...

    async def retry_after_s(self, sources: Sequence[str]) -> float:
        """Minimum wait until one of ``sources`` admits again, >= 0. Empty -> ValueError."""
        ...

    async def aclose(self) -> None: ...


@runtime_checkable
class ScopedGates(Protocol):
    """Optional for a ``ProviderGate`` that several scopes may share (the builtin memory gate
    and the Redis gate): ``for_scope(scope)`` is the gate holding that scope's sources.

    Breaker state is per scope and source (ARCHITECTURE §7.7): a ``openai-1`` of LLM and a
    ``openai-1`` of EMBED are two breakers even when one instance is passed to both clients.
    The owner scope (the one the gate was built for, else the first to ask) gets the gate
    itself; every other scope a gate of its own, the same one each time it asks, built with
    the same thresholds and on the same backend (for Redis: the keys that scope's own gate
    uses). The governor asks once, when it is built (``governance.admission.scope_breaker``).
    A gate without ``for_scope`` (defined on its class: a wrapper forwarding attributes to
    another gate does not count) keys sources by their bare names: do not share it between
    scopes whose source names can meet.
    """

    def for_scope(self, scope: str) -> ProviderGate: ...


JointAdmit: TypeAlias = Callable[
    [str, int, Limits], Awaitable[tuple[GateDecision, Permit | Denial | None]]
]
"""``(source, est_tokens, source_limits) -> (decision, permit or denial)``: the gate's
``try_enter`` and, when it lets the caller through, the limiter's ``try_acquire``, in one step;
the second part is ``None`` when the gate refuses. Cancelled or failing, it hands back the
probe and frees the lease it may have taken, as the two calls would."""


@runtime_checkable
class JointAdmission(Protocol):
    """Optional, for a ``RateLimiter`` whose backend can also ask a ``ProviderGate`` in the
    same round trip (both on one server): ``joint_with(gate)`` returns the joint step, or
    ``None`` for a gate it cannot ask. The results are those of the two separate calls."""

    def joint_with(self, gate: ProviderGate) -> JointAdmit | None: ...


@runtime_checkable
class QueuedAdmission(Protocol):
    """Optional, for a ``RateLimiter`` that can keep a call refused by a full concurrency
    gate in line for the next released slot, so the caller need not poll.

    ``acquire_queued`` is ``try_acquire`` that, refused by a concurrency gate, waits up to
    ``timeout_s`` (on the limiter's clock) for a slot handed over first come, first served;
    then it returns the permit, or the refusal of a last try. Cancelled after a slot was
    handed over, the slot goes on to the next in line."""

    async def acquire_queued(
        self, source: str, est_tokens: int, source_limits: Limits, timeout_s: float
    ) -> Permit | Denial: ...


# --------------------------------------------------------------------------- cache, telemetry


@runtime_checkable
class CacheBackend(Protocol):
    """Key/value store with mandatory TTL. Failures degrade: get -> None, set -> warning."""

    async def get(self, key: str) -> str | None: ...

    async def set(self, key: str, value: str, ttl_s: float) -> None: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class TelemetryRecorder(Protocol):
    """Append-only, idempotent on ``call_id``. Never raises into the call; never blocks the loop.

    ``flush``/``aclose`` write everything buffered so a graceful shutdown loses nothing.
    """

    async def record(self, record: TelemetryRecord) -> None: ...

    async def flush(self) -> None: ...

    async def aclose(self) -> None: ...


class TelemetryReader(Protocol):
    """Reads stored telemetry back (kind ``telemetry_reader``, what ``pgw telemetry report``
    uses): every row (the 18 fields, ``created_at`` in epoch seconds) created at or after
    ``since``, oldest first. An unreadable ``target`` raises ``ValueError`` naming the problem,
    never a password."""

    def __call__(self, target: str, *, since: float | None) -> list[dict[str, Any]]: ...


@runtime_checkable
class SupportsCacheNowait(Protocol):
    """Optional for a ``CacheBackend`` that answers without waiting (the memory cache).

    ``get_nowait``/``set_nowait`` are the same operations as ``get``/``set``, synchronous: the
    cache layer then spares a coroutine per lookup and per store. Checked once, when the layer
    is built; ``CacheContract`` holds both forms to the same behaviour.
    """

    def get_nowait(self, key: str) -> str | None: ...

    def set_nowait(self, key: str, value: str, ttl_s: float) -> None: ...


@runtime_checkable
class SupportsCacheObjects(Protocol):
    """Optional for a ``CacheBackend`` in the caller's own process (the memory cache): it keeps
    Python objects as they are, with the same TTL and eviction as its strings.

    The cache layer then stores what a hit is built from (the response's fields, immutable
    values) instead of encoding the response as JSON on every miss and decoding it on a hit:
    nothing leaves the process, so nothing needs encoding. ``get_object`` answers ``None`` for
    a missing or expired key; ``set_object`` refuses a TTL as ``set`` does, and ``None`` as a
    value (it reads as absent). An entry holds what was stored in it: ``get``/``get_nowait``
    read only string entries. Checked once, when the layer is built; ``CacheContract`` holds
    the object form to the same TTL behaviour.
    """

    def get_object(self, key: str) -> object | None: ...

    def set_object(self, key: str, value: object, ttl_s: float) -> None: ...


class CallTrace(Protocol):
    """The rows of one call, handed to a recorder together (``SupportsCallTraces.open_call``).

    ``attempt`` gets every row of the call as it is made (attempts, a cache hit, the row of a
    call refused before any attempt) with the outcome it was built from: the call kind's
    result (``LLMResponse`` for chat, ``records.AttemptSummary`` for other kinds) or the
    exception. ``close`` is called once, when the call ends (``error`` is what it raised, or
    ``None``), with the clock's wall time. Both are synchronous, must not block and never
    raise into the call.
    """

    def attempt(self, record: TelemetryRecord, outcome: object) -> None: ...

    def close(self, ended_at: float, error: BaseException | None) -> None: ...


@runtime_checkable
class SupportsGovernanceEvents(Protocol):
    """Optional for a ``CallTrace``: also told about the governor's admissions, refusals and
    waits of the call (``types.GovernanceEvent``), synchronously, as they happen."""

    def on_governance(self, event: GovernanceEvent) -> None: ...


@runtime_checkable
class SupportsCallTraces(Protocol):
    """Optional for a ``TelemetryRecorder`` that wants each call's rows together (tracing).

    ``open_call`` runs in the caller's task when a call starts, so context-local state there
    (an application's current tracing span) is the caller's. The rows of that call then go to
    the returned ``CallTrace`` instead of ``record``/``record_nowait``. Checked once, when the
    telemetry layer is built.
    """

    def open_call(self, start: CallStart) -> CallTrace: ...


@runtime_checkable
class DeclaresContentUse(Protocol):
    """Optional for a ``TelemetryRecorder``: ``wants_content`` is ``False`` when it never reads
    a row's content (``messages``, ``response``, ``thinking``). Its rows may then leave the
    prompt empty, which spares encoding it on every call. Read once, when the telemetry layer
    is built; a recorder without it gets every field."""

    @property
    def wants_content(self) -> bool: ...


@runtime_checkable
class SupportsRecordNowait(Protocol):
    """Optional for a ``TelemetryRecorder`` that can enqueue a row synchronously.

    ``record_nowait`` is ``record`` without the await (it never blocks and never raises for
    backend trouble); the telemetry layer then spares a task per row. Checked once, when the
    layer is built; ``TelemetryRecorderContract`` holds both forms to the same behaviour.
    """

    def record_nowait(self, record: TelemetryRecord) -> None: ...


@runtime_checkable
class SupportsRecordValues(Protocol):
    """Optional for a ``TelemetryRecorder`` with ``record_nowait``: a row given as its values.

    ``record_values_nowait(values)`` is ``record_nowait(TelemetryRecord(*values))``
    (``types.TelemetryValues``: every field, in field order). The telemetry layer hands the
    usual attempt's row so, without making the record object it would only take apart again.
    Checked once, when the layer is built; ``TelemetryRecorderContract`` holds the two forms
    to the same rows.
    """

    def record_values_nowait(self, values: TelemetryValues) -> None: ...


@runtime_checkable
class Pricing(Protocol):
    def cost(
        self,
        model: str,
        prompt_tokens: int,
        completion_tokens: int,
        *,
        cached_tokens: int = 0,
        cache_write_tokens: int = 0,
    ) -> float | None:
        """Money for one call; ``None`` when the model has no price. ``cached_tokens`` and
        ``cache_write_tokens`` are the parts of ``prompt_tokens`` read from / written to the
        provider's prompt cache (the caller passes them only when non-zero)."""
        ...


# --------------------------------------------------------------------------- selection, structured


@runtime_checkable
class SourceSelector(Protocol):
    """Picks one of the runnable sources (already filtered: not cooling, not excluded)."""

    def choose(
        self, sources: Sequence[SourceConfig], inflight: Mapping[str, int]
    ) -> SourceConfig: ...


@runtime_checkable
class StructuredOutputStrategy(Protocol):
    """Turns raw completion text into data (ARCHITECTURE D7/D14)."""

    def prepare(
        self, request: ChatRequest, schema: Any, profile: ProviderProfile | None
    ) -> ChatRequest:
        """Return the request to send (e.g. with ``response_format`` for native schema)."""
        ...

    def parse(self, text: str, schema: Any) -> Any:
        """Repair (and validate against ``schema`` when it is a model class).

        Raises ``ResultInvalidError`` with ``repair_errors``/``validation_errors`` filled.
        """
        ...


# --------------------------------------------------------------------------- assembly


@frozen_dataclass(slots=True)
class Components:
    """The parts one client is assembled from; middleware factories receive them."""

    limiter: RateLimiter
    breaker: ProviderGate
    selector: SourceSelector
    transports: Mapping[str, Transport]
    """Source name -> the transport instance serving it."""
    providers: Mapping[str, ProviderProfile]
    """Provider name -> profile (every registered profile)."""
    strategy: StructuredOutputStrategy
    cache: CacheBackend | None = None
    telemetry: TelemetryRecorder | None = None
    pricing: Pricing | None = None


OptionsT = TypeVar("OptionsT", covariant=True)


# No slots: ``BuildContext(...)`` instantiates through the generic alias, which records
# ``__orig_class__`` on the instance (refused quietly by a frozen dataclass, not by slots).
@frozen_dataclass
class ComponentContext(Generic[OptionsT]):
    """What a component factory gets: the resolved scope, its own options, the clock.

    ``options`` is the validated options model instance when the factory was registered with
    ``register(name, factory, options=Model)`` (type the factory's argument
    ``ComponentContext[Model]``), else the raw mapping (``BuildContext``). ``components`` is
    set only for middleware factories (built after every other part).
    """

    settings: ScopeSettings
    options: OptionsT
    clock: Clock
    components: Components | None = None


BuildContext: TypeAlias = ComponentContext[Mapping[str, Any]]
"""The context of a factory registered without an options model: options as a mapping."""

ComponentFactory: TypeAlias = Callable[[ComponentContext[Any]], Any]


class Register(Protocol):
    """The callback every registration hook receives.

    ``register(name, factory_or_profile)``, or ``register(name, factory, options=Model)`` with
    ``Model`` a ``polygateway.options.ComponentOptions`` subclass: the loader then validates the
    component's options with it and the factory gets the instance as ``ctx.options``.
    ``options=OptionsRef("module:Model", env_keys=...)`` names the model instead, imported only
    when the component's options are used.
    """

    def __call__(
        self, name: str, obj: Any, /, *, options: type[Any] | OptionsRef | None = None
    ) -> None: ...
