"""``keepalive_s`` means the same on every engine, through the fake upstream: idle connections
are kept and taken again (the default, 15 s), and ``0`` keeps none, so each request opens its
own connection (it used to mean "forever" on the httptools engine and "none" elsewhere)."""

from __future__ import annotations

import json

import pytest
from polygateway.testing import FakeUpstream
from polygateway.transports.engines import ACCEPT_ENCODING, EngineConfig, make_engine
from test_openai_compat import ENGINES

REQUEST = json.dumps(
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": False}
).encode()


@pytest.mark.parametrize("engine_name", ENGINES)
@pytest.mark.parametrize(("keepalive_s", "opened"), [(15.0, 1), (0.0, 3)], ids=["kept", "none"])
async def test_keepalive_zero_keeps_no_idle_connection_on_every_engine(
    fake_upstream: FakeUpstream, engine_name: str, keepalive_s: float, opened: int
) -> None:
    config = EngineConfig(
        source_name="keepalive",
        headers={"Content-Type": "application/json", "Accept-Encoding": ACCEPT_ENCODING},
        plain_http=True,
        keepalive_s=keepalive_s,
    )
    engine = make_engine(engine_name, config)
    try:
        for _ in range(3):
            response = await engine.post(
                fake_upstream.base_url("keepalive") + "/chat/completions", REQUEST
            )
            assert response.status == 200
            assert json.loads(await response.read())["choices"]
            await response.aclose()
        assert fake_upstream.requests("keepalive") == 3
        assert fake_upstream.accepted_connections == opened
    finally:
        await engine.aclose()
