"""Structured output layer: the D14 ladder (ARCHITECTURE §7.9).

``structured=None``: pass through. ``"json"``: repair only (no re-ask) -> ``structured_data``
is a dict or list. A pydantic model: ① native schema when every provider of the scope supports
it, ② repair, ③ validation, ④ up to ``max_retries`` re-asks with feedback, ⑤ then
``ResultInvalidError`` with the raw text, the repair and validation errors and the attempt
count. A re-ask always carries the native schema where the providers support it, even when
the strategy did not ask for it on the first attempt (repair failed: the prompt convention was
not enough, so the re-ask escalates to the protocol constraint).

A re-ask is ``call_next`` again, so it passes the limiter and breaker like any request and is
recorded in telemetry; its messages are a new list: the caller's messages, the bad output as
an assistant turn, and a user turn listing the first errors. The caller's list is never
modified. Because the messages differ, a re-ask never hits the cache entry of the bad answer.

Truncated output (``finish_reason == "length"``) is never repaired: json-repair would close the
brackets and fill defaults, and the truncated data could then pass validation. It counts as a
failed rung: with a model schema it is re-asked (the feedback asks for a shorter reply) while
re-asks remain; in ``"json"`` mode, which never re-asks, it fails at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from polygateway.errors import ConfigError, RequestRejectedError, ResultInvalidError
from polygateway.ports import Handler, ProviderProfile, StructuredOutputStrategy
from polygateway.settings import SourceConfig
from polygateway.structured.json_repair import is_model_schema
from polygateway.structured.native_schema import NativeSchemaStrategy
from polygateway.types import ChatRequest, LLMResponse, Message

FEEDBACK_MAX_ERRORS = 3
FEEDBACK_ERROR_CHARS = 200
FEEDBACK_TEMPLATE = (
    "Your previous reply could not be used: it must be a single JSON value that matches the "
    "required schema.\n"
    "Problems found:\n"
    "{errors}\n"
    "Reply again with only the corrected JSON: no explanation, no Markdown code fences."
)
"""The re-ask instruction (English, fixed); ``{errors}`` is one ``- ...`` line per error."""

MAX_STRUCTURED_CHARS = 1_000_000
"""Longer output is refused (``ResultInvalidError``) before any parsing: even the C JSON
decoder holds the interpreter for tens of milliseconds per megabyte, and no structured answer
of a chat model is that large unless something went wrong."""

OFFLOAD_CHARS = 32 * 1024
"""Output at least this long is parsed in a worker thread, so that a slow parse or repair
never blocks the event loop (smaller output parses in well under a millisecond)."""

TRUNCATED_ERROR = (
    "the reply was cut off at the output token limit (finish_reason=length); "
    "it was not repaired: reply with shorter, complete JSON"
)


def feedback_message(errors: Sequence[str]) -> str:
    """The user turn of a re-ask: the first 3 errors, each cut to 200 characters."""
    lines = []
    for error in list(errors)[:FEEDBACK_MAX_ERRORS]:
        text = " ".join(str(error).split())  # one line per error, whatever the error contained
        if len(text) > FEEDBACK_ERROR_CHARS:
            text = text[: FEEDBACK_ERROR_CHARS - 3] + "..."
        lines.append(f"- {text}")
    if not lines:
        lines.append("- the reply did not match the schema")
    return FEEDBACK_TEMPLATE.format(errors="\n".join(lines))


def reask_messages(
    messages: Sequence[Message], bad_output: str, errors: Sequence[str]
) -> list[Message]:
    """A new list: the caller's messages + the bad output + the feedback (input untouched)."""
    return [
        *messages,
        {"role": "assistant", "content": bad_output},
        {"role": "user", "content": feedback_message(errors)},
    ]


def scope_profile(
    providers: Mapping[str, ProviderProfile], sources: Sequence[SourceConfig]
) -> ProviderProfile | None:
    """The profile the strategy sees: native schema only if every source's provider has it.

    Any source may serve any attempt (retries switch sources), so one provider without native
    schema support means none is requested; that provider's profile is returned instead.
    """
    profiles = [providers.get(source.provider) for source in sources]
    if not profiles:
        return None
    for profile in profiles:
        if profile is None or not profile.supports_native_schema:
            return profile
    return profiles[0]


class StructuredMiddleware:
    """Turns the completion into ``structured_data`` (or ``ResultInvalidError``)."""

    __slots__ = ("_escalation", "_profile", "_strategy", "max_retries")

    structured_only = True
    """A request with ``structured=None`` passes through untouched (``ports.StructuredOnly``):
    the assembly sends such requests past this layer."""

    def __init__(
        self,
        strategy: StructuredOutputStrategy,
        *,
        providers: Mapping[str, ProviderProfile],
        sources: Sequence[SourceConfig],
        max_retries: int,
    ) -> None:
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise ConfigError(
                "max_structured_retries must be an int >= 0 (0 = never re-ask), "
                f"got {max_retries!r}"
            )
        self._strategy = strategy
        self._profile = scope_profile(providers, sources)
        self.max_retries = max_retries
        # What re-asks add when the first attempt went without the native schema.
        self._escalation = NativeSchemaStrategy() if self.native_schema else None

    @property
    def native_schema(self) -> bool:
        """Whether pydantic-model calls ask the providers for native JSON schema output."""
        return self._profile is not None and self._profile.supports_native_schema

    async def __call__(self, request: ChatRequest, call_next: Handler) -> LLMResponse:
        schema = request.structured
        if schema is None:
            return await call_next(request)
        if schema == "json":
            return await self._repair_only(request, call_next)
        if not is_model_schema(schema):  # imports pydantic only for a class
            raise RequestRejectedError(
                "structured must be None, 'json' or a pydantic BaseModel subclass, "
                f"got {schema!r} ({type(schema).__name__})"
            )
        return await self._ladder(request, schema, call_next)

    async def _repair_only(self, request: ChatRequest, call_next: Handler) -> LLMResponse:
        response = await call_next(self._strategy.prepare(request, "json", self._profile))
        outcome = await self._check(response, "json")
        if isinstance(outcome, ResultInvalidError):
            _tell_observer(request, response, outcome)
            raise _exhausted(response, outcome, attempts=1) from outcome
        return dataclasses.replace(response, structured_data=outcome)

    async def _ladder(self, request: ChatRequest, schema: Any, call_next: Handler) -> LLMResponse:
        prepared = self._strategy.prepare(request, schema, self._profile)
        current = prepared
        attempts = 0
        while True:
            attempts += 1
            response = await call_next(current)
            outcome = await self._check(response, schema)
            if not isinstance(outcome, ResultInvalidError):
                return dataclasses.replace(response, structured_data=outcome)
            _tell_observer(request, response, outcome)
            if attempts > self.max_retries:
                raise _exhausted(response, outcome, attempts=attempts) from outcome
            errors = [*outcome.repair_errors, *outcome.validation_errors] or [str(outcome)]
            current = dataclasses.replace(
                prepared, messages=reask_messages(request.messages, response.content, errors)
            )
            escalation = self._escalation
            if escalation is not None and current.response_format is None:
                current = escalation.prepare(current, schema, self._profile)

    async def _check(self, response: LLMResponse, schema: Any) -> Any:
        """The parsed data, or the ``ResultInvalidError`` describing why there is none."""
        text = response.content
        if response.finish_reason == "length":
            return ResultInvalidError(
                "structured output truncated (finish_reason=length)",
                raw_text=text,
                repair_errors=[TRUNCATED_ERROR],
            )
        if len(text) > MAX_STRUCTURED_CHARS:
            message = (
                f"structured output too large to parse: {len(text)} characters "
                f"> {MAX_STRUCTURED_CHARS}"
            )
            return ResultInvalidError(message, raw_text=text, repair_errors=[message])
        try:
            if len(text) >= OFFLOAD_CHARS:
                return await asyncio.to_thread(self._strategy.parse, text, schema)
            return self._strategy.parse(text, schema)
        except ResultInvalidError as exc:
            return exc
        except RecursionError:  # a strategy's parser on deeply nested output
            message = "structured output nested too deeply to parse"
            return ResultInvalidError(message, raw_text=text, repair_errors=[message])

    def __repr__(self) -> str:
        return (
            f"StructuredMiddleware(strategy={type(self._strategy).__name__}, "
            f"max_retries={self.max_retries}, native_schema={self.native_schema})"
        )


def _tell_observer(request: ChatRequest, response: LLMResponse, error: ResultInvalidError) -> None:
    # Lets the telemetry layer mark this attempt's row (the context never raises).
    context = request.context
    if context is not None and response.call_id:
        context.result_invalid(response.call_id, error)


def _exhausted(
    response: LLMResponse, last: ResultInvalidError, *, attempts: int
) -> ResultInvalidError:
    first = ([*last.repair_errors, *last.validation_errors] or [str(last)])[0]
    return ResultInvalidError(
        f"structured output invalid after {attempts} attempt(s): {first}",
        raw_text=response.content,
        repair_errors=last.repair_errors,
        validation_errors=last.validation_errors,
        attempts=attempts,
    )


__all__ = [
    "FEEDBACK_ERROR_CHARS",
    "FEEDBACK_MAX_ERRORS",
    "FEEDBACK_TEMPLATE",
    "MAX_STRUCTURED_CHARS",
    "OFFLOAD_CHARS",
    "TRUNCATED_ERROR",
    "StructuredMiddleware",
    "feedback_message",
    "reask_messages",
    "scope_profile",
]
