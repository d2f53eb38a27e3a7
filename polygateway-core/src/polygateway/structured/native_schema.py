"""Native JSON-schema strategy: rung ① of the D14 ladder.

When every provider of the scope declares ``supports_native_schema`` and the caller passed a
pydantic model, the request carries ``response_format = {"type": "json_schema", ...}`` so the
provider constrains the output itself. Parsing is the repair strategy's (a provider may still
wrap the JSON in a fence), so the ladder's later rungs work unchanged.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from polygateway.ports import ProviderProfile
from polygateway.structured.json_repair import JsonRepairStrategy, Normalizer, is_model_schema
from polygateway.types import ChatRequest

_NAME_UNSAFE = re.compile(r"[^a-zA-Z0-9_-]")
MAX_SCHEMA_NAME = 64
MEMO_SIZE = 1024


def schema_name(model: type[Any]) -> str:
    """The model's name as OpenAI accepts it: ``[a-zA-Z0-9_-]``, at most 64 characters."""
    name = _NAME_UNSAFE.sub("_", getattr(model, "__name__", "") or "")[:MAX_SCHEMA_NAME]
    return name or "schema"


class NativeSchemaStrategy:
    """``response_format`` JSON schema where supported; repair + validation otherwise."""

    __slots__ = ("_formats", "_repair")

    def __init__(self, normalize: Normalizer | None = None) -> None:
        self._repair = JsonRepairStrategy(normalize)
        # model class -> response_format; model_json_schema() costs tens of microseconds.
        self._formats: dict[type[Any], dict[str, Any]] = {}

    @property
    def normalize(self) -> Normalizer | None:
        return self._repair.normalize

    def response_format(self, model: type[Any]) -> dict[str, Any]:
        fmt = self._formats.get(model)
        if fmt is None:
            fmt = {
                "type": "json_schema",
                "json_schema": {
                    "name": schema_name(model),
                    "schema": model.model_json_schema(),
                    # strict mode rejects common pydantic schemas (defaults, optional fields);
                    # validation happens here anyway.
                    "strict": False,
                },
            }
            if len(self._formats) >= MEMO_SIZE:  # models made per call must not leak
                self._formats.clear()
            self._formats[model] = fmt
        return fmt

    def prepare(
        self, request: ChatRequest, schema: Any, profile: ProviderProfile | None
    ) -> ChatRequest:
        if profile is None or not profile.supports_native_schema or not is_model_schema(schema):
            return request
        return dataclasses.replace(request, response_format=self.response_format(schema))

    def parse(self, text: str, schema: Any) -> Any:
        return self._repair.parse(text, schema)


__all__ = ["MAX_SCHEMA_NAME", "NativeSchemaStrategy", "schema_name"]
