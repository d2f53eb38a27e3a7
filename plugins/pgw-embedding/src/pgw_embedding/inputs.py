"""What the caller hands ``embed``: checks before any request, batches, token estimates, and
the embedding options of a source.

Source options (``options`` of a source in the pipeline file; strings are accepted):

- ``encoding_format``: ``base64`` (default, as the official SDK sends) or ``float``;
- ``dimensions``: an integer >= 1, sent as the request's ``dimensions`` (text-embedding-3 and
  later; other models reject it);
- ``max_input_chars``: the longest text (in characters) the source accepts. A call holding a
  longer text is refused before any request when any source of the scope declares a smaller
  limit: every batch may land on any source.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from polygateway.errors import ConfigError, RequestRejectedError
from polygateway.settings import SourceConfig
from polygateway.transports.openai_compat import CHARS_PER_TOKEN

EncodingFormat = Literal["base64", "float"]
ENCODING_FORMATS: tuple[EncodingFormat, ...] = ("base64", "float")


def option_int(options: Mapping[str, Any], key: str, source_name: str) -> int | None:
    """``options[key]`` as an integer >= 1, ``None`` when absent; ``ConfigError`` otherwise."""
    value = options.get(key)
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    number: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str) and value.strip().isdigit():
        number = int(value.strip())
    if number is None or number < 1:
        raise ConfigError(
            f"source {source_name!r}: option {key!r} must be an integer >= 1, got {value!r}"
        )
    return number


def encoding_format(options: Mapping[str, Any], source_name: str) -> EncodingFormat:
    value = str(options.get("encoding_format", "base64")).strip().lower()
    for choice in ENCODING_FORMATS:
        if value == choice:
            return choice
    raise ConfigError(
        f"source {source_name!r}: option 'encoding_format' must be one of "
        f"{', '.join(ENCODING_FORMATS)}, got {options.get('encoding_format')!r}"
    )


def max_input_chars(sources: Iterable[SourceConfig]) -> tuple[int, str] | None:
    """The smallest ``max_input_chars`` any of ``sources`` declares, with that source's name."""
    smallest: tuple[int, str] | None = None
    for source in sources:
        limit = option_int(source.options, "max_input_chars", source.name)
        if limit is not None and (smallest is None or limit < smallest[0]):
            smallest = (limit, source.name)
    return smallest


def check_texts(texts: object, limit: tuple[int, str] | None = None) -> list[str]:
    """``texts`` itself when it is a list of non-empty strings within ``limit`` (characters,
    declaring source); ``RequestRejectedError`` naming the first offending item otherwise."""
    if not isinstance(texts, list):
        hint = " (wrap a single text in a list)" if isinstance(texts, str) else ""
        raise RequestRejectedError(
            f"texts must be a list of strings, got {type(texts).__name__}{hint}"
        )
    for index, text in enumerate(texts):
        if not isinstance(text, str):
            raise RequestRejectedError(
                f"texts[{index}] must be a string, got {type(text).__name__}"
            )
        if not text:
            raise RequestRejectedError(
                f"texts[{index}] is an empty string, which embedding APIs reject"
            )
        if limit is not None and len(text) > limit[0]:
            raise RequestRejectedError(
                f"texts[{index}] has {len(text)} characters, more than the {limit[0]} that "
                f"source {limit[1]!r} declares as its max input (option max_input_chars)"
            )
    return texts


def split_batches(texts: list[str], batch_size: int) -> list[list[str]]:
    """``texts`` cut into consecutive batches of at most ``batch_size``, in order."""
    if type(batch_size) is not int or batch_size < 1:
        raise ConfigError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    return [texts[start : start + batch_size] for start in range(0, len(texts), batch_size)]


def estimate_tokens(texts: Iterable[str]) -> int:
    """About 4 characters per token (the chat transport's estimate), at least 1."""
    return max(1, math.ceil(sum(map(len, texts)) / CHARS_PER_TOKEN))


__all__ = [
    "ENCODING_FORMATS",
    "EncodingFormat",
    "check_texts",
    "encoding_format",
    "estimate_tokens",
    "max_input_chars",
    "option_int",
    "split_batches",
]
