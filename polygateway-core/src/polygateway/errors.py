"""The error model (ARCHITECTURE §6): four classes that drive retry, switching and the breaker.

| class                  | retry        | switch source | breaker        |
|------------------------|--------------|---------------|----------------|
| TransientError         | yes, backoff | yes           | failure        |
| SourceDeadError        | no           | at once       | force open     |
| RequestRejectedError   | no           | no            | not counted    |
| ResultInvalidError     | re-ask only  | no            | success        |

Two rejections name what is wrong so the governor can act on it (both ``RequestRejectedError``,
never re-sent to the same source, never counted by the breaker):
``ContextWindowExceededError`` (tried again only on sources declaring a larger
``context_window``) and ``ContentFilterError`` (another source only when the scope allows it).

Scope-level unavailability (``CircuitOpenError``, ``AllSourcesExhausted``) carries a
``retry_after_s`` the caller can schedule on. Messages never contain secrets.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal, TypeAlias

ScopeReason: TypeAlias = Literal[
    "circuit_open", "retry_exhausted", "stalled", "quota_exhausted", "no_sources"
]
SCOPE_REASONS: tuple[str, ...] = (
    "circuit_open",
    "retry_exhausted",
    "stalled",
    "quota_exhausted",
    "no_sources",
)
SourceReason: TypeAlias = Literal[
    "network_error", "timeout", "rate_limited", "source_dead", "circuit_open", "cooldown"
]
SOURCE_REASONS: tuple[str, ...] = (
    "network_error",
    "timeout",
    "rate_limited",
    "source_dead",
    "circuit_open",
    "cooldown",
)


class PolyGatewayError(Exception):
    """Base class of every error this library raises."""


class TransientError(PolyGatewayError):
    """Timeouts, 5xx, 429 (rate), network faults, broken streams, empty completions."""

    def __init__(
        self,
        message: str,
        *,
        retry_after_s: float | None = None,
        status: int | None = None,
        source_name: str | None = None,
        reason: SourceReason = "network_error",
    ) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.status = status
        self.source_name = source_name
        self.reason: SourceReason = reason


class StreamLivenessTimeout(TransientError):
    """The stream watchdog fired: no first token, a gap between tokens, or the total deadline."""

    def __init__(
        self,
        kind: Literal["ttft", "inter_token", "total"],
        limit_s: float,
        *,
        source_name: str | None = None,
    ) -> None:
        super().__init__(
            f"stream liveness timeout: {kind} exceeded {limit_s:g}s",
            source_name=source_name,
            reason="timeout",
        )
        self.kind: Literal["ttft", "inter_token", "total"] = kind
        self.limit_s = limit_s


class EmptyCompletionError(TransientError):
    """A well-formed answer with no content and no tool call (a reasoning model that spent its
    whole token budget thinking, an upstream glitch): transient for a call, but it proves the
    source is up, which is all a health probe asks."""


class SourceDeadError(PolyGatewayError):
    """401/403, exhausted quota or credit: the source is unusable until someone acts."""

    def __init__(
        self, message: str, *, status: int | None = None, source_name: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.source_name = source_name


class RequestRejectedError(PolyGatewayError):
    """400 or bad input: the request itself is wrong; no retry, no switch, no breaker count."""

    def __init__(
        self, message: str, *, status: int | None = None, source_name: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.source_name = source_name


class ContextWindowExceededError(RequestRejectedError):
    """The request does not fit the source's context window (``context_length_exceeded`` and
    the other providers' wordings): never re-sent to this source; only a source declaring a
    larger ``context_window`` may take it."""


class ContentFilterError(RequestRejectedError):
    """The provider's content policy refused the request or the answer (a 400 content-policy
    rejection, or ``finish_reason: content_filter``); ``reason`` is the provider's wording."""

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        source_name: str | None = None,
        reason: str = "content_filter",
    ) -> None:
        super().__init__(message, status=status, source_name=source_name)
        self.reason = reason


class ResultInvalidError(PolyGatewayError):
    """The call succeeded but its content cannot be used (bad JSON, schema mismatch, bad ZIP).

    A bad result is not a bad service: the breaker records success.
    """

    def __init__(
        self,
        message: str,
        *,
        raw_text: str = "",
        repair_errors: Sequence[str] = (),
        validation_errors: Sequence[str] = (),
        attempts: int = 1,
    ) -> None:
        super().__init__(message)
        self.raw_text = raw_text
        self.repair_errors: tuple[str, ...] = tuple(repair_errors)
        self.validation_errors: tuple[str, ...] = tuple(validation_errors)
        self.attempts = attempts


class ScopeUnavailableError(PolyGatewayError):
    """Base of scope-level unavailability: no source can take the call right now."""

    def __init__(
        self,
        message: str,
        *,
        retry_after_s: float,
        reason: ScopeReason,
        per_source_reasons: Mapping[str, str] | None = None,
        last_error: BaseException | None = None,
    ) -> None:
        if reason not in SCOPE_REASONS:
            raise ValueError(f"unknown scope reason {reason!r}; allowed: {SCOPE_REASONS}")
        super().__init__(message)
        self.retry_after_s = max(0.0, float(retry_after_s))
        self.reason: ScopeReason = reason
        self.per_source_reasons: dict[str, str] = dict(per_source_reasons or {})
        self.last_error = last_error

    def __str__(self) -> str:
        base = super().__str__()
        detail = ", ".join(f"{k}={v}" for k, v in sorted(self.per_source_reasons.items()))
        extra = f" [{detail}]" if detail else ""
        return f"{base} (reason={self.reason}, retry_after_s={self.retry_after_s:.3f}){extra}"


class CircuitOpenError(ScopeUnavailableError):
    """Every source's breaker is open."""


class AllSourcesExhausted(ScopeUnavailableError):
    """Retries are spent, every source is dead or cooling, the quota is full, or it stalled."""


class GovernanceBackendError(PolyGatewayError):
    """The limiter or breaker backend failed on the admission side: fail closed, never pass."""


class ConfigError(PolyGatewayError):
    """Configuration is missing or invalid. ``problems``: one line per problem, naming the key."""

    def __init__(self, problems: str | Sequence[str]) -> None:
        items = [problems] if isinstance(problems, str) else list(problems)
        self.problems: tuple[str, ...] = tuple(items)
        super().__init__("; ".join(self.problems) if self.problems else "invalid configuration")


class PluginError(ConfigError):
    """A plugin failed to load or two plugins registered the same name for one kind."""


class StructuredSpecError(RequestRejectedError, TypeError):
    """``structured=`` is neither ``None``, ``"json"`` nor a pydantic model class: a bad
    request (nothing is sent) and a ``TypeError`` (a wrong argument type)."""


class ClientClosedError(PolyGatewayError):
    """A call on a client after ``aclose()`` (a programming error, never retried)."""


class ResponseClosedError(PolyGatewayError):
    """A read of an HTTP engine's response after its ``aclose()``, before the end of its body
    (a programming error of the transport reading it, never retried)."""


__all__ = [
    "SCOPE_REASONS",
    "SOURCE_REASONS",
    "AllSourcesExhausted",
    "CircuitOpenError",
    "ClientClosedError",
    "ConfigError",
    "ContentFilterError",
    "ContextWindowExceededError",
    "EmptyCompletionError",
    "GovernanceBackendError",
    "PluginError",
    "PolyGatewayError",
    "RequestRejectedError",
    "ResponseClosedError",
    "ResultInvalidError",
    "ScopeReason",
    "ScopeUnavailableError",
    "SourceDeadError",
    "SourceReason",
    "StreamLivenessTimeout",
    "StructuredSpecError",
    "TransientError",
]
