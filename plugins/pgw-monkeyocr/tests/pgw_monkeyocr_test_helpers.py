"""Shared helpers of the pgw-monkeyocr tests (importable: the tests directory is on sys.path)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pgw_monkeyocr.transport import MonkeyOcrTransport
from polygateway.settings import SourceConfig

MakeTransport = Callable[..., MonkeyOcrTransport]


def monkey_source(base_url: str, name: str = "monkey-1", **fields: Any) -> SourceConfig:
    """A MonkeyOCR source of scope ``OCR`` (no model: the server has one)."""
    fields.setdefault("timeout_s", 30.0)
    return SourceConfig(
        name=name, provider="monkey", base_url=base_url, model="", scope="OCR", **fields
    )
