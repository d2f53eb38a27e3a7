"""PolyGateway embeddings (entry point ``polygateway: embedding``).

``EmbeddingClient.from_env(scope="EMBED")`` gives governed embeddings: batches of
``EMBED__BATCH_SIZE`` texts, each a full governed call on the core's governor, vectors back in
input order. The plugin registers the ``openai-compat`` embedding transport
(``POST {base_url}/embeddings``) through ``pgw_register_embedding_transports``; other embedding
transports plug in through the same hook.

Implementations are imported on first use, so loading the plugin costs nothing for a process
that never embeds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from polygateway.hookspecs import hookimpl
from polygateway.ports import Register
from polygateway.settings import SourceConfig

if TYPE_CHECKING:
    from pgw_embedding.client import EmbeddingClient
    from pgw_embedding.transport import OpenAICompatEmbeddingTransport


@hookimpl
def pgw_register_embedding_transports(register: Register) -> None:
    def openai_compat(source: SourceConfig) -> Any:
        from pgw_embedding.transport import OpenAICompatEmbeddingTransport

        return OpenAICompatEmbeddingTransport(source)

    register("openai-compat", openai_compat)


_LAZY = {
    "EmbeddingClient": "pgw_embedding.client",
    "OpenAICompatEmbeddingTransport": "pgw_embedding.transport",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pgw_embedding' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = ["EmbeddingClient", "OpenAICompatEmbeddingTransport"]
