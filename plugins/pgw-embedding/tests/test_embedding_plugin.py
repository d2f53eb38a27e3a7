"""The plugin as users meet it: its entry point registers the embedding transport."""

from __future__ import annotations

import pytest
from pgw_embedding.transport import OpenAICompatEmbeddingTransport
from pgw_embedding_test_helpers import embed_source
from polygateway.ports import EmbeddingTransport


def test_the_entry_point_registers_openai_compat_for_embeddings() -> None:
    from polygateway.plugins import load_registry

    registry = load_registry()
    info = next(p for p in registry.plugins if p.name == "pgw-embedding")
    assert info.status == "loaded", info.error
    assert info.entry_point == "embedding"
    assert dict(info.provides) == {"embedding_transport": ("openai-compat",)}
    assert registry.provider_of("embedding_transport", "openai-compat") == "pgw-embedding"
    transport = registry.get("embedding_transport", "openai-compat")(
        embed_source(None, "e1", base_url="http://127.0.0.1:1/v1")
    )
    assert isinstance(transport, OpenAICompatEmbeddingTransport)
    assert isinstance(transport, EmbeddingTransport)
    assert transport.url == "http://127.0.0.1:1/v1/embeddings"


def test_lazy_exports() -> None:
    import pgw_embedding

    assert pgw_embedding.OpenAICompatEmbeddingTransport is OpenAICompatEmbeddingTransport
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = pgw_embedding.nope
