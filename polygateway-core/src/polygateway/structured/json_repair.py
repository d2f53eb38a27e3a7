"""Repair-then-validate strategy: rungs ② and ③ of the D14 ladder, zero network.

``parse`` strips Markdown code fences, takes the first JSON object or array in the text
(models like to add a sentence before or after), falls back to ``json_repair`` for broken JSON,
applies the caller's normalizer, then validates against the pydantic model if one was given.

json_repair pitfalls handled here: hopeless input comes back as ``""`` (not an error), so an
empty or scalar result is a failure; ``skip_json_loads`` is never used (it can corrupt valid
JSON). Truncated output (``finish_reason == "length"``) is refused by the structured layer
before it gets here, because json_repair would happily "complete" it with defaults.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from polygateway.errors import ResultInvalidError
from polygateway.ports import ProviderProfile
from polygateway.types import ChatRequest

if TYPE_CHECKING:
    from pydantic import ValidationError

Normalizer = Callable[[Any], Any]

# The first fenced block, with or without a language tag; a missing closing fence (the model
# stopped early) is tolerated.
_FENCE = re.compile(r"```[ \t]*(?:[A-Za-z0-9_+-]+)?[ \t]*\r?\n?(.*?)(?:```|\Z)", re.DOTALL)
_DECODER = json.JSONDecoder()
_INPUT_PREVIEW_CHARS = 80

MAX_REPAIR_CHARS = 64 * 1024
"""Longer broken JSON is not repaired: json_repair is pure Python (tens of microseconds per
character on hostile input such as ``{{{{...``), so a larger repair would hold a thread for
seconds. Valid JSON of any size is still parsed by the strict decoders."""


def is_model_schema(schema: Any) -> bool:
    """True for a pydantic model class (the full-ladder form of ``structured=``)."""
    if not isinstance(schema, type):
        return False
    # pydantic is imported only when a class is given: "json" and None need none of it
    from pydantic import BaseModel

    return issubclass(schema, BaseModel)


def check_schema(schema: Any) -> None:
    """Raise ``TypeError`` unless ``schema`` is ``"json"`` or a pydantic model class."""
    if schema == "json" or is_model_schema(schema):
        return
    raise TypeError(
        "structured must be None, 'json' or a pydantic BaseModel subclass, "
        f"got {schema!r} ({type(schema).__name__})"
    )


def strip_fences(text: str) -> str:
    """The content of the first Markdown code fence, or the text itself when there is none."""
    if "```" not in text:
        return text
    match = _FENCE.search(text)
    return match.group(1) if match else text


def extract_json(text: str) -> tuple[Any, list[str]]:
    """The first JSON object/array in ``text`` (repaired if needed) and the repair errors.

    Returns ``(value, [])`` on success and ``(None, errors)`` when nothing usable was found.
    """
    candidate = strip_fences(text).strip()
    if not candidate:
        return None, ["the output is empty: expected a JSON object or array"]
    scalar_error = ""
    try:
        value = json.loads(candidate)
    except RecursionError:
        strict_error: str = "not valid JSON: nested too deeply"
    except ValueError as exc:
        strict_error = f"not valid JSON: {exc}"
    else:
        if isinstance(value, dict | list):
            return value, []
        scalar_error = f"expected a JSON object or array, got a JSON {type(value).__name__}"
        strict_error = scalar_error
    start = _first_container(candidate)
    if start < 0:
        return None, [scalar_error or "no JSON object or array found in the output"]
    try:
        # The first complete value wins; text after it (an explanation, a second object) is
        # ignored rather than merged.
        value, _ = _DECODER.raw_decode(candidate, start)
    except (ValueError, RecursionError):
        pass
    else:
        if isinstance(value, dict | list):
            return value, []
    if len(candidate) - start > MAX_REPAIR_CHARS:
        size = len(candidate) - start
        return None, [
            f"{strict_error}; too large to repair ({size} characters > {MAX_REPAIR_CHARS})"
        ]
    try:
        # Imported on the first repair (once, about 13 ms): a large package whose objects the
        # garbage collector would walk on every full collection of processes that never
        # repair. A broken install is a repair failure like any other.
        import json_repair

        repaired = json_repair.repair_json(candidate[start:], return_objects=True)
    except Exception as exc:  # noqa: BLE001 - a third-party parser failing is a repair failure
        return None, [f"{strict_error}; json-repair failed: {type(exc).__name__}: {exc}"]
    if (
        candidate[start] == "{"
        and isinstance(repaired, list)
        and repaired
        and isinstance(repaired[0], dict)
    ):
        # json_repair turns "{...} {...}" into a list of both: keep the first object.
        repaired = repaired[0]
    # An empty container here means json_repair gave up on something like "{oops": a complete
    # "{}" would already have been returned by the strict decoders above.
    if isinstance(repaired, dict | list) and repaired:
        return repaired, []
    return None, [f"{strict_error}; json-repair could not recover a JSON object or array"]


def _first_container(text: str) -> int:
    brace, bracket = text.find("{"), text.find("[")
    if brace < 0:
        return bracket
    if bracket < 0:
        return brace
    return min(brace, bracket)


def format_validation_errors(error: ValidationError) -> list[str]:
    """One line per pydantic error: ``location: message (got <input>)``."""
    lines: list[str] = []
    for item in error.errors(include_url=False):
        location = ".".join(str(part) for part in item.get("loc", ())) or "<root>"
        line = f"{location}: {item.get('msg', 'invalid')}"
        if "input" in item and item.get("type") != "missing":
            preview = repr(item["input"])
            if len(preview) > _INPUT_PREVIEW_CHARS:
                preview = preview[: _INPUT_PREVIEW_CHARS - 3] + "..."
            line += f" (got {preview})"
        lines.append(line)
    return lines


class JsonRepairStrategy:
    """Prompt-convention JSON: repair what the model wrote, then validate it.

    ``normalize`` (optional) reshapes the parsed value before validation, e.g. to fold a
    provider's flattened variant back into the expected nesting; it is the caller's, because
    such quirks belong to a specific schema, not to the library.
    """

    __slots__ = ("normalize",)

    def __init__(self, normalize: Normalizer | None = None) -> None:
        if normalize is not None and not callable(normalize):
            raise TypeError(f"normalize must be callable or None, got {normalize!r}")
        self.normalize = normalize

    def prepare(
        self, request: ChatRequest, schema: Any, profile: ProviderProfile | None
    ) -> ChatRequest:
        return request

    def parse(self, text: str, schema: Any) -> Any:
        """``"json"`` -> dict/list; a model class -> a validated instance.

        Raises ``ResultInvalidError`` (``repair_errors`` / ``validation_errors`` filled) when
        the text holds no usable JSON or it does not fit the model; ``TypeError`` for a schema
        that is neither.
        """
        check_schema(schema)
        value, repair_errors = extract_json(text)
        if repair_errors:
            raise ResultInvalidError(
                f"no usable JSON in the output: {repair_errors[0]}",
                raw_text=text,
                repair_errors=repair_errors,
            )
        if self.normalize is not None:
            try:
                value = self.normalize(value)
            except Exception as exc:  # the caller's hook rejecting the shape is a bad result
                message = f"normalize failed: {type(exc).__name__}: {exc}"
                raise ResultInvalidError(message, raw_text=text, repair_errors=[message]) from exc
        if schema == "json":
            if not isinstance(value, dict | list):
                message = f"normalize returned {type(value).__name__}, expected a dict or list"
                raise ResultInvalidError(message, raw_text=text, repair_errors=[message])
            return value
        from pydantic import ValidationError

        try:
            return schema.model_validate(value)
        except RecursionError:
            message = f"output does not match {schema.__name__}: nested too deeply"
            error = ResultInvalidError(message, raw_text=text, validation_errors=[message])
        except ValidationError as exc:
            errors = format_validation_errors(exc)
            raise ResultInvalidError(
                f"output does not match {schema.__name__}: {errors[0] if errors else exc}",
                raw_text=text,
                validation_errors=errors,
            ) from None
        raise error  # outside the handler: a RecursionError traceback is no use to anyone


__all__ = [
    "MAX_REPAIR_CHARS",
    "JsonRepairStrategy",
    "Normalizer",
    "check_schema",
    "extract_json",
    "format_validation_errors",
    "is_model_schema",
    "strip_fences",
]
