"""Fixtures of the pgw-redis suite: the machine's Redis, Redis servers of our own, a Cluster.

Same rule as the repository's other suites: a missing service skips the test, unless
``PGW_REQUIRE_SERVICES=1`` (CI), which turns the skip into a failure. Servers this suite
starts itself (a spare ``redis-server`` for restart tests, a 3-master Cluster) need the
``redis-server`` and ``redis-cli`` binaries.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from pgw_redis_test_helpers import RedisServer, binaries, free_port, missing, reachable

pytest.register_assert_rewrite("polygateway.testing.contracts")

REDIS_HOST, REDIS_PORT = "127.0.0.1", 6379


@pytest.fixture
def redis_url() -> str:
    """URL of the machine's Redis (database 3, reserved for tests)."""
    if not reachable(REDIS_HOST, REDIS_PORT):
        missing(f"Redis is not reachable on {REDIS_HOST}:{REDIS_PORT}")
    return f"redis://{REDIS_HOST}:{REDIS_PORT}/3"


@pytest.fixture(scope="module")
def module_redis_url() -> str:
    """``redis_url`` for module-scoped fixtures."""
    if not reachable(REDIS_HOST, REDIS_PORT):
        missing(f"Redis is not reachable on {REDIS_HOST}:{REDIS_PORT}")
    return f"redis://{REDIS_HOST}:{REDIS_PORT}/3"


@pytest.fixture
def unique_scope() -> str:
    """A scope name no other test uses (isolates shared Redis state)."""
    return f"T{uuid.uuid4().hex[:10]}"


@pytest.fixture
def spare_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A private Redis on a spare port, killed after the test (restart/fault tests)."""
    server = RedisServer(free_port(), tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@dataclass
class RedisClusterNodes:
    nodes: list[RedisServer]

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterNodes]:
    """A local 3-master Redis Cluster on spare ports, for the whole session."""
    _, cli = binaries()
    workdir = Path(tempfile.mkdtemp(prefix="pgw-redis-cluster-"))
    nodes: list[RedisServer] = []
    try:
        for index in range(3):
            port = free_port(also_free_plus=10000)
            node_dir = workdir / str(index)
            node_dir.mkdir()
            node = RedisServer(
                port,
                node_dir,
                extra=(
                    "--cluster-enabled", "yes",
                    "--cluster-config-file", str(node_dir / "nodes.conf"),
                    "--cluster-node-timeout", "5000",
                ),
            )  # fmt: skip
            node.start()
            nodes.append(node)
        subprocess.run(
            [
                cli, "--cluster", "create",
                *(f"127.0.0.1:{node.port}" for node in nodes),
                "--cluster-replicas", "0", "--cluster-yes",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=30,
        )  # fmt: skip
        _wait_cluster_ok(cli, nodes)
        yield RedisClusterNodes(nodes)
    finally:
        for node in nodes:
            node.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def _wait_cluster_ok(cli: str, nodes: list[RedisServer], deadline_s: float = 30.0) -> None:
    deadline = time.monotonic() + deadline_s
    for node in nodes:
        while True:
            info = subprocess.run(
                [cli, "-p", str(node.port), "cluster", "info"],
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout
            if "cluster_state:ok" in info:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster node {node.port} not ok: {info}")
            time.sleep(0.05)


@pytest.fixture(params=["redis", "cluster"])
def any_redis_url(request: pytest.FixtureRequest) -> str:
    """The machine's Redis, then the suite's own 3-master Cluster."""
    if request.param == "redis":
        url: str = request.getfixturevalue("redis_url")
        return url
    cluster: RedisClusterNodes = request.getfixturevalue("redis_cluster")
    return cluster.url


@pytest.fixture
async def raw_redis(redis_url: str) -> AsyncIterator[object]:
    """A plain client on the machine's Redis (database 3) for looking at keys directly."""
    from redis.asyncio import Redis

    client = Redis.from_url(redis_url, decode_responses=True)
    try:
        yield client
    finally:
        await client.aclose()
