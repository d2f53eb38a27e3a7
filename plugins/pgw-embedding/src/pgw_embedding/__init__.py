"""PolyGateway embeddings: the ``openai-compat`` embedding transport (entry point
``polygateway: embedding``).

The transport posts one batch to ``{base_url}/embeddings`` and returns its vectors in input
order; ``pgw_embedding.inputs`` checks what the caller gives, ``pgw_embedding.vectors`` decodes
and checks what comes back. Implementations are imported on first use, so loading the plugin
costs nothing for a process that never embeds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pgw_embedding.transport import OpenAICompatEmbeddingTransport

_LAZY = {"OpenAICompatEmbeddingTransport": "pgw_embedding.transport"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pgw_embedding' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = ["OpenAICompatEmbeddingTransport"]
