"""Telemetry recorders and pricing.

``SQLiteRecorder`` (``polygateway.telemetry.sqlite``) is the builtin recorder; ``PricingTable``
(``polygateway.telemetry.pricing``) turns token usage into money. Submodules are imported on
use so that picking another recorder never imports sqlite3.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from polygateway.telemetry.pricing import PricingTable
    from polygateway.telemetry.sqlite import SQLiteRecorder

_LAZY = {
    "PricingTable": "polygateway.telemetry.pricing",
    "SQLiteRecorder": "polygateway.telemetry.sqlite",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'polygateway.telemetry' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = ["PricingTable", "SQLiteRecorder"]
