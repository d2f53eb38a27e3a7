"""Public value types. Frozen dataclasses; every field added after 0.1 carries a default.

These types import nothing concrete: transports, backends and middleware all speak them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import field
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeAlias

from typing_extensions import TypeVar

from polygateway.frozen import frozen_dataclass
from polygateway.params import ChatParams

if TYPE_CHECKING:
    from polygateway.context import CallContext

Message: TypeAlias = Mapping[str, Any]
"""One OpenAI-style chat message: ``{"role": ..., "content": str | list[part]}``."""

UsageSource: TypeAlias = Literal["measured", "estimated"]
StructuredSpec: TypeAlias = Any
"""``None`` (raw text), ``"json"`` (repair only) or a pydantic model class (full ladder)."""

DataT = TypeVar("DataT", default=Any)
"""The type of ``LLMResponse.structured_data``: the model class given as ``structured=``,
``Any`` for ``"json"``, ``None`` for raw text. A bare ``LLMResponse`` is ``LLMResponse[Any]``."""


@frozen_dataclass(slots=True)
class Usage:
    """Token usage of one call. OCR has no token billing: tokens are 0, elapsed is still set."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    elapsed_ms: int = 0
    usage_source: UsageSource = "measured"

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@frozen_dataclass(slots=True)
class ToolCall:
    """One function call the model asked for (OpenAI ``tool_calls[i]``, Anthropic
    ``tool_use``). ``arguments`` is the raw JSON text as the model wrote it."""

    id: str
    name: str
    arguments: str = ""

    def parsed_arguments(self) -> Any:
        """``arguments`` parsed as JSON (``{}`` when empty); ``ValueError`` naming the call
        when the model wrote something else."""
        if not self.arguments.strip():
            return {}
        try:
            return json.loads(self.arguments)
        except ValueError as exc:
            raise ValueError(
                f"tool call {self.id!r} ({self.name}): arguments are not JSON: {exc}"
            ) from None

    def as_message(self) -> dict[str, Any]:
        """The OpenAI ``tool_calls`` entry of an assistant message (to send the call back)."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


DeltaKind: TypeAlias = Literal["content", "thinking", "tool_call", "restart"]


@frozen_dataclass(slots=True)
class StreamDelta:
    """One piece of a streamed answer (``GatewayClient.stream``).

    ``content`` / ``thinking``: ``text`` is the new text. ``tool_call``: a fragment of call
    ``index``; its first fragment carries ``tool_call_id`` and ``name``, ``text`` is the next
    piece of the arguments JSON. ``restart``: the attempt that produced the deltas so far was
    cut and another attempt starts from scratch (only with ``restart_on_cut=True``): discard
    what was shown.
    """

    kind: DeltaKind
    text: str = ""
    index: int = 0
    tool_call_id: str = ""
    name: str = ""


def assistant_message(response: LLMResponse) -> dict[str, Any]:
    """The assistant turn of ``response`` for the next request: its content and, when the
    model called tools, its ``tool_calls`` (answer each with a ``{"role": "tool",
    "tool_call_id": ..., "content": ...}`` message)."""
    message: dict[str, Any] = {"role": "assistant", "content": response.content or None}
    if response.tool_calls:
        message["tool_calls"] = [call.as_message() for call in response.tool_calls]
    return message


# Not slotted: ``LLMResponse[Invoice](...)`` sets ``__orig_class__`` on the instance, which a
# slotted frozen dataclass rejects with a TypeError on Python 3.11.
@frozen_dataclass
class LLMResponse(Generic[DataT]):
    """The result of one governed chat call (ARCHITECTURE §5.1).

    The first eleven fields are the frozen consumer surface; later fields have defaults.
    ``structured_data`` is never serialized into the cache; a cache hit rebuilds it. Its
    type follows ``structured=``: ``chat(messages, structured=Invoice)`` is typed
    ``LLMResponse[Invoice]``, ``structured="json"`` ``LLMResponse[Any]``, no ``structured``
    ``LLMResponse[None]``.
    """

    content: str
    thinking: str = ""
    model: str = ""
    provider: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_ms: int = 0
    ttft_ms: float | None = None
    max_inter_token_ms: float | None = None
    cache_hit: bool = False
    call_id: str = ""
    source_name: str = ""
    cost: float | None = None
    usage_source: UsageSource = "measured"
    structured_data: DataT = field(default=None, compare=False)  # type: ignore[assignment]
    finish_reason: str | None = None
    salvaged: bool = False
    """The stream ended without ``[DONE]`` and ``missing_done="salvage"`` kept what arrived:
    possibly truncated, so it is never cached."""
    cached_prompt_tokens: int = 0
    """Prompt tokens read from the provider's prompt cache (included in ``prompt_tokens``)."""
    cache_write_tokens: int = 0
    """Prompt tokens written to the provider's prompt cache (included in ``prompt_tokens``)."""
    tool_calls: tuple[ToolCall, ...] = ()
    """The tools the model called (``finish_reason="tool_calls"``); ``content`` may be empty."""


@frozen_dataclass
class TransportResult:
    """What a transport returns for one attempt, before middleware adds provenance."""

    content: str
    thinking: str = ""
    model: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    usage_source: UsageSource = "measured"
    latency_ms: int = 0
    ttft_ms: float | None = None
    max_inter_token_ms: float | None = None
    finish_reason: str | None = None
    salvaged: bool = False
    """Set when the answer is what arrived before the stream ended without ``[DONE]``."""
    cached_prompt_tokens: int = 0
    """Prompt tokens read from the provider's prompt cache, included in ``prompt_tokens``
    (OpenAI ``prompt_tokens_details.cached_tokens``, Anthropic ``cache_read_input_tokens``)."""
    cache_write_tokens: int = 0
    """Prompt tokens written to the prompt cache, included in ``prompt_tokens`` (Anthropic
    ``cache_creation_input_tokens``): priced at their own rate, never twice."""
    tool_calls: tuple[ToolCall, ...] = ()


@frozen_dataclass
class ChatRequest:
    """One chat call as it travels through the middleware onion.

    Middleware never mutates a request; it derives a new one with ``dataclasses.replace``.
    ``messages`` is the caller's list and is never modified in place.
    """

    messages: Sequence[Message]
    session_id: str | None = None
    parent_call_id: str | None = None
    cache_salt: str | None = None
    cache_namespace: str | None = None
    structured: StructuredSpec = None
    stream: bool = True
    response_format: Mapping[str, Any] | None = None
    """Set by the native-schema strategy; sent as the body's ``response_format``."""
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    """Extra top-level body fields merged into every attempt's request body."""
    params: ChatParams | None = None
    """Per-call generation parameters (``polygateway.params``), over the source's defaults."""
    deadline_s: float | None = None
    """End-to-end deadline of the call (``None``: the scope's ``retry.call_deadline_s``)."""
    context: CallContext | None = field(default=None, compare=False, repr=False)
    """The call's ``polygateway.context.CallContext`` (observers, shared encodings): set by
    ``GatewayClient.chat``, kept by every derived request. Must stay the last field."""


@frozen_dataclass
class TelemetryRecord:
    """One telemetry row: the 18 fields of ARCHITECTURE §7.8. One row per attempt or cache hit.

    No ``__slots__``: its ``__init__`` writes the row's ``__dict__`` at once
    (``polygateway.frozen.frozen_dataclass``)."""

    call_id: str
    parent_call_id: str | None
    session_id: str | None
    model: str
    provider: str
    source_name: str
    messages: str
    """JSON of the request messages with multimodal parts replaced by their digests."""
    response: str
    thinking: str
    prompt_tokens: int
    completion_tokens: int
    usage_source: UsageSource
    latency_ms: int
    ttft_ms: float | None
    max_inter_token_ms: float | None
    cache_hit: bool
    error: str | None
    """``None`` on success; otherwise the error class name or ``"cancelled"``."""
    cost: float | None
    created_at: float = 0.0
    """Wall-clock seconds since the epoch when the row was made (not one of the 18 fields)."""
    scope: str = ""
    """The scope (logical role, e.g. ``LLM``, ``JUDGE``) the call ran in."""
    cache_namespace: str = ""
    """The call's cache namespace (tenant): per-call, else the scope's; ``""`` when none."""
    params: str = ""
    """Canonical JSON of the call's own generation parameters (``""`` when none were set)."""
    root_call_id: str = ""
    """The call this row belongs to: the ``call_id`` of the call's first row, the same on every
    attempt (retries, switches, re-asks) of one call; equal to ``call_id`` for a call of one
    row. ``""`` from a recorder that predates it (read as a call of its own)."""


TelemetryValues: TypeAlias = tuple[
    str,  # call_id
    str | None,  # parent_call_id
    str | None,  # session_id
    str,  # model
    str,  # provider
    str,  # source_name
    str,  # messages
    str,  # response
    str,  # thinking
    int,  # prompt_tokens
    int,  # completion_tokens
    UsageSource,  # usage_source
    int,  # latency_ms
    float | None,  # ttft_ms
    float | None,  # max_inter_token_ms
    bool,  # cache_hit
    str | None,  # error
    float | None,  # cost
    float,  # created_at
    str,  # scope
    str,  # cache_namespace
    str,  # params
    str,  # root_call_id
]
"""A ``TelemetryRecord``'s field values in field order: ``TelemetryRecord(*values)`` is the
record (``ports.SupportsRecordValues``: a row handed over without the object)."""


GovernanceEventKind: TypeAlias = Literal["admitted", "breaker_refused", "limiter_refused", "waited"]


@frozen_dataclass
class GovernanceEvent:
    """A decision the governor made during one call, besides an attempt's outcome.

    ``admitted``: the breaker (in ``breaker_state``; ``probe`` when this attempt is the
    half-open probe) and the limiter let an attempt go to ``source``. ``breaker_refused`` /
    ``limiter_refused``: ``source`` was refused this round (``gate`` names the limiter gate),
    ``wait_s`` is the hint. ``waited``: no source admitted the call, and it waited ``wait_s``
    seconds for quota or a breaker before the next round.
    """

    kind: GovernanceEventKind
    source: str = ""
    breaker_state: str = ""
    probe: bool = False
    gate: str = ""
    wait_s: float = 0.0


@frozen_dataclass
class CallStart:
    """What a recorder learns when one governed call starts (``SupportsCallTraces``).

    ``operation`` is the call kind (``chat``, ``embeddings``, ``ocr``); ``started_at`` is
    wall-clock epoch seconds from the client's clock, like ``TelemetryRecord.created_at``.
    """

    operation: str
    started_at: float
    scope: str = ""
    session_id: str | None = None
    parent_call_id: str | None = None
    cache_namespace: str = ""
    stream: bool = False
    """The caller reads the answer as a stream (``GatewayClient.stream``)."""


def admitted_event(source: str, breaker_state: str, probe: bool) -> GovernanceEvent:
    """``GovernanceEvent("admitted", source, breaker_state, probe)``: the event of every
    admitted attempt a recorder listens to."""
    return GovernanceEvent("admitted", source, breaker_state, probe)


@frozen_dataclass(slots=True)
class OcrTextResult:
    """``/ocr/text``: plain transcription. Empty text means "legitimately nothing found"."""

    text: str
    source_name: str = ""
    usage: Usage = field(default_factory=Usage)
    raw: Mapping[str, Any] = field(default_factory=dict)


@frozen_dataclass(slots=True)
class OcrElement:
    """One layout element in the OCR service's own page coordinates."""

    type: str
    bbox: tuple[float, float, float, float]
    page_idx: int = 0
    text: str = ""
    html: str | None = None
    latex: str | None = None
    """Equations, and tables the service recognised as LaTeX instead of HTML."""


@frozen_dataclass(slots=True)
class OcrBBoxIssue:
    """A layout element left out of ``OcrLayoutResult.elements`` because its bbox is unusable
    (not four finite numbers, ``x0 >= x1`` or ``y0 >= y1``, or outside the page beyond the
    tolerance)."""

    page_idx: int
    type: str
    bbox: str
    """The bbox as the service sent it (JSON text)."""
    reason: str
    text: str = ""


@frozen_dataclass(slots=True)
class OcrLayoutResult:
    """``/parse``: structured elements with native bboxes and page sizes.

    ``page_sizes[i]`` is the size of page ``i`` (one entry per page of a PDF, in the service's
    page units, the same as the bboxes). No elements is a legitimately empty page, not an error.
    """

    elements: tuple[OcrElement, ...]
    page_sizes: tuple[tuple[float, float], ...] = ()
    source_name: str = ""
    usage: Usage = field(default_factory=Usage)
    raw: Mapping[str, Any] = field(default_factory=dict)
    bbox_issues: tuple[OcrBBoxIssue, ...] = ()
    """Elements whose bbox failed validation (reported here instead of raising)."""

    @property
    def page_size(self) -> tuple[float, float] | None:
        return self.page_sizes[0] if self.page_sizes else None


@frozen_dataclass(slots=True)
class EmbeddingTransportResult:
    """One embedding batch as returned by a transport (vectors ordered by input index)."""

    vectors: list[list[float]]
    dim: int
    prompt_tokens: int
    usage_source: UsageSource = "measured"
    model: str = ""
    raw: Mapping[str, Any] = field(default_factory=dict)


@frozen_dataclass(slots=True)
class EmbeddingResponse:
    """All batches of one ``EmbeddingClient.embed`` call merged (M2 §7.2)."""

    vectors: list[list[float]]
    dim: int
    model: str
    provider: str
    prompt_tokens: int
    usage_source: UsageSource
    latency_ms: int
    call_id: str
    source_name: str
    cost: float | None = None
