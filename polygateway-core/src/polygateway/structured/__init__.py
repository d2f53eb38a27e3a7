"""Structured output strategies (ARCHITECTURE D7/D14): raw completion text -> data.

``JsonRepairStrategy`` repairs (fences, first JSON value, json-repair, an injectable
normalizer) and validates against a pydantic model; ``NativeSchemaStrategy`` additionally asks
providers that support it for ``response_format`` JSON schema output. The ladder around them
(validation feedback, bounded re-asks) is ``polygateway.middleware.structured``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from polygateway.structured.json_repair import JsonRepairStrategy
    from polygateway.structured.native_schema import NativeSchemaStrategy

_LAZY = {
    "JsonRepairStrategy": "polygateway.structured.json_repair",
    "NativeSchemaStrategy": "polygateway.structured.native_schema",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'polygateway.structured' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = ["JsonRepairStrategy", "NativeSchemaStrategy"]
