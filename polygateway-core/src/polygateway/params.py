"""Per-call generation parameters (ARCHITECTURE §5.2: ``ChatRequest`` carries per-call overrides).

``ChatParams`` is the typed, frozen set of OpenAI-compatible request parameters a caller sets
on ``GatewayClient.chat`` (``temperature``, ``max_tokens``, ``tools``, a per-call ``model``, ...).
A source may carry defaults for the same fields (``{SCOPE}__{P}__{N}__TEMPERATURE``, ...);
per-call values win (``ChatParams.over``). The transport turns the merged set into body fields
through the provider profile (``body_fields``: ``max_tokens`` is sent as
``max_completion_tokens`` where the profile says so); the cache key includes the per-call set
(``identity``), since it changes the answer.

``params_problems`` checks values before any request; ``GatewayClient.chat`` raises
``RequestRejectedError`` naming the field, the config loader ``ConfigError``.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any

from polygateway.errors import RequestRejectedError
from polygateway.frozen import frozen_dataclass

__all__ = ["ChatParams", "body_fields", "check_params", "identity", "params_problems"]

TOOL_CHOICES = ("none", "auto", "required")


@frozen_dataclass(slots=True)
class ChatParams:
    """Generation parameters of one call (or a source's defaults); ``None`` = not set."""

    model: str | None = None
    """Overrides the source's ``model`` for this call."""
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    """Output token cap; sent as the profile's ``max_tokens_field``."""
    stop: str | tuple[str, ...] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    tools: tuple[Mapping[str, Any], ...] | None = None
    """OpenAI tool definitions (``{"type": "function", "function": {"name": ...}}``)."""
    tool_choice: str | Mapping[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: Mapping[str, Any] | None = None
    user: str | None = None
    extra_body: Mapping[str, Any] | None = None
    """Top-level body fields merged last (after the provider profile's)."""

    def is_empty(self) -> bool:
        # Every field read in one C call and compared by identity in C: no Python-level
        # loop over the fields on every call.
        return all(map(operator.is_, _field_values(self), _UNSET))

    def over(self, defaults: ChatParams) -> ChatParams:
        """These values over ``defaults`` (a source's): set fields win; ``extra_body`` merges."""
        if defaults.is_empty():
            return self
        if self.is_empty():
            return defaults
        values = {
            f.name: (
                own if (own := getattr(self, f.name)) is not None else getattr(defaults, f.name)
            )
            for f in fields(self)
        }
        if self.extra_body is not None and defaults.extra_body is not None:
            values["extra_body"] = {**defaults.extra_body, **self.extra_body}
        return ChatParams(**values)


_field_values = operator.attrgetter(*(f.name for f in fields(ChatParams)))
"""Every field of a ``ChatParams``, as a tuple in declaration order."""
_UNSET = (None,) * len(fields(ChatParams))


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _range(name: str, value: Any, low: float, high: float) -> list[tuple[str, str]]:
    if value is None:
        return []
    if not _number(value) or not low <= value <= high:
        return [(name, f"must be a number from {low:g} to {high:g}, got {value!r}")]
    return []


def _tool_problems(tools: Any) -> list[tuple[str, str]]:
    if not isinstance(tools, Sequence) or isinstance(tools, str | bytes):
        return [("tools", f"must be a list of tool definitions, got {type(tools).__name__}")]
    problems: list[tuple[str, str]] = []
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        name = function.get("name") if isinstance(function, Mapping) else None
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            problems.append((f"tools[{index}]", 'must be {"type": "function", "function": ...}'))
        elif not isinstance(name, str) or not name:
            problems.append((f"tools[{index}].function.name", "must be a non-empty string"))
    return problems


def params_problems(params: ChatParams) -> list[tuple[str, str]]:
    """``(field, problem)`` for every bad value (empty when all are acceptable)."""
    # Any: callers outside the type checker pass anything; every value is checked.
    p: Any = params
    problems: list[tuple[str, str]] = []
    if p.model is not None and (not isinstance(p.model, str) or not p.model):
        problems.append(("model", f"must be a non-empty string, got {p.model!r}"))
    problems += _range("temperature", p.temperature, 0.0, 2.0)
    problems += _range("top_p", p.top_p, 0.0, 1.0)
    problems += _range("presence_penalty", p.presence_penalty, -2.0, 2.0)
    problems += _range("frequency_penalty", p.frequency_penalty, -2.0, 2.0)
    if p.max_tokens is not None and (not _integer(p.max_tokens) or p.max_tokens < 1):
        problems.append(("max_tokens", f"must be an integer >= 1, got {p.max_tokens!r}"))
    if p.seed is not None and not _integer(p.seed):
        problems.append(("seed", f"must be an integer, got {p.seed!r}"))
    stop = p.stop
    if stop is not None and not (
        (isinstance(stop, str) and stop)
        or (isinstance(stop, tuple | list) and stop and all(isinstance(s, str) and s for s in stop))
    ):
        problems.append(("stop", "must be a non-empty string or a list of non-empty strings"))
    if p.tools is not None:
        problems += _tool_problems(p.tools)
    choice = p.tool_choice
    if choice is not None and not (
        (isinstance(choice, str) and choice in TOOL_CHOICES) or isinstance(choice, Mapping)
    ):
        problems.append(("tool_choice", f"must be one of {TOOL_CHOICES} or a mapping"))
    if p.parallel_tool_calls is not None and not isinstance(p.parallel_tool_calls, bool):
        problems.append(("parallel_tool_calls", "must be a bool"))
    rf = p.response_format
    if rf is not None and not (isinstance(rf, Mapping) and isinstance(rf.get("type"), str)):
        problems.append(("response_format", 'must be a mapping with a "type", e.g. json_object'))
    if p.user is not None and not isinstance(p.user, str):
        problems.append(("user", "must be a string"))
    extra = p.extra_body
    if extra is not None and not (
        isinstance(extra, Mapping) and all(type(k) is str for k in extra)
    ):
        problems.append(("extra_body", "must be a mapping with string keys"))
    return problems


def check_params(params: ChatParams) -> None:
    """Raise ``RequestRejectedError`` naming every bad field (before any request)."""
    problems = params_problems(params)
    if problems:
        raise RequestRejectedError(
            "bad request parameters: " + "; ".join(f"{name}: {why}" for name, why in problems)
        )


_PLAIN = (
    "temperature",
    "top_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    "user",
)


def body_fields(params: ChatParams, *, max_tokens_field: str = "max_tokens") -> dict[str, Any]:
    """The OpenAI-compatible body fields of ``params`` (``model`` and ``extra_body`` excluded:
    the transport places those)."""
    body: dict[str, Any] = {}
    if params.max_tokens is not None:
        body[max_tokens_field] = params.max_tokens
    if params.stop is not None:
        body["stop"] = params.stop if isinstance(params.stop, str) else list(params.stop)
    if params.tools is not None:
        body["tools"] = [dict(tool) for tool in params.tools]
    for name in _PLAIN:
        value = getattr(params, name)
        if value is not None:
            body[name] = value
    return body


def identity(params: ChatParams | None) -> dict[str, Any] | None:
    """What of ``params`` the cache key hashes (``None`` when nothing is set)."""
    if params is None or params.is_empty():
        return None
    out = body_fields(params)
    if params.model is not None:
        out["model"] = params.model
    if params.extra_body:
        out["extra_body"] = dict(params.extra_body)
    return out
