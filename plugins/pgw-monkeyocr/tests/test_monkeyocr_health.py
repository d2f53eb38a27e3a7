"""``check_health`` over ``GET /health`` and the per-source ``trust_env`` switch."""

from __future__ import annotations

import socket

import pytest
from pgw_monkeyocr.testing import FakeMonkeyOcr, make_png
from pgw_monkeyocr.transport import MonkeyOcrTransport
from pgw_monkeyocr_test_helpers import MakeTransport, monkey_source
from polygateway.errors import TransientError


def _dead_port() -> int:
    """A loopback port nobody listens on (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


async def test_a_loaded_model_is_healthy(make_transport: MakeTransport) -> None:
    assert await make_transport("a").check_health() is True


async def test_model_not_loaded_is_unhealthy(
    fake_monkeyocr: FakeMonkeyOcr, make_transport: MakeTransport
) -> None:
    fake_monkeyocr.configure("a", model_loaded=False)
    assert await make_transport("a").check_health() is False
    assert await make_transport("b").check_health() is True


async def test_an_error_status_is_unhealthy(
    fake_monkeyocr: FakeMonkeyOcr, make_transport: MakeTransport
) -> None:
    fake_monkeyocr.configure("a", health_status=503)
    assert await make_transport("a").check_health() is False


async def test_an_unreachable_server_is_unhealthy_not_an_exception() -> None:
    transport = MonkeyOcrTransport(monkey_source(f"http://127.0.0.1:{_dead_port()}"))
    try:
        assert await transport.check_health() is False
    finally:
        await transport.aclose()


@pytest.mark.parametrize("trust_env", [False, True])
async def test_trust_env_decides_whether_a_proxy_from_the_environment_is_used(
    monkeypatch: pytest.MonkeyPatch, make_transport: MakeTransport, trust_env: bool
) -> None:
    # A proxy that is down: used only by a source that trusts the environment.
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{_dead_port()}")
    monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{_dead_port()}")
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    transport = make_transport("a", trust_env=str(trust_env).lower())
    assert transport.options.trust_env is trust_env
    assert await transport.check_health() is (not trust_env)
    if trust_env:
        with pytest.raises(TransientError, match="network error"):
            await transport.recognize_text(make_png())
    else:
        assert (await transport.recognize_text(make_png())).text
