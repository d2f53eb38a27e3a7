"""Testing aids shipped with the library: a fake OpenAI-compatible upstream, a fake clock and
contract suites for backend implementations."""

from __future__ import annotations

import importlib
from typing import Any

from polygateway.testing.fake_upstream import FakeUpstream, ReceivedRequest, Reply

__all__ = ["FakeClock", "FakeUpstream", "ReceivedRequest", "Reply", "contracts"]

# Imported on first use so that this package works before (and without) them.
_LAZY_ATTRIBUTES = {"FakeClock": ("polygateway.testing.clock", "FakeClock")}
_LAZY_MODULES = {"contracts": "polygateway.testing.contracts"}


def __getattr__(name: str) -> Any:
    if name in _LAZY_ATTRIBUTES:
        module, attribute = _LAZY_ATTRIBUTES[name]
        return getattr(importlib.import_module(module), attribute)
    if name in _LAZY_MODULES:
        return importlib.import_module(_LAZY_MODULES[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
