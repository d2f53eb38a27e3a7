"""Real services in test suites: a service that is not there skips the test on a laptop and
fails it where the services are promised (CI).

The caller says which (``required``, e.g. from ``PGW_REQUIRE_SERVICES=1`` read by its
``conftest.py``): nothing here reads the environment.
"""

from __future__ import annotations

import socket
from typing import NoReturn


def reachable(host: str, port: int, *, timeout_s: float = 1.0) -> bool:
    """Whether something accepts TCP connections on ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def missing(message: str, *, required: bool) -> NoReturn:
    """Skip the test for want of a service (``message`` says which), or fail it when the
    service is ``required``."""
    import pytest

    if required:
        pytest.fail(f"{message} and PGW_REQUIRE_SERVICES=1")
    pytest.skip(message)


def require_service(name: str, host: str, port: int, *, required: bool) -> None:
    """Return when ``name`` answers on ``host:port``; otherwise ``missing``."""
    if not reachable(host, port):
        missing(f"{name} is not reachable on {host}:{port}", required=required)


def free_port(*, also_free_plus: int = 0) -> int:
    """A TCP port of 127.0.0.1 free now (and ``port + also_free_plus`` too, e.g. a Redis
    Cluster bus port)."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        if also_free_plus == 0:
            return port
        if port + also_free_plus < 65536:
            with socket.socket() as bus:
                try:
                    bus.bind(("127.0.0.1", port + also_free_plus))
                except OSError:
                    continue
            return port
    raise RuntimeError("no free port found")


__all__ = ["free_port", "missing", "reachable", "require_service"]
