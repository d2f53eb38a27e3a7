"""pytest plugin (entry point ``pytest11``): the ``fake_upstream`` fixture.

One server per test session, run in its own thread so it serves sync tests and async tests on
any event loop alike; every test gets it reset (scripts, defaults, counters).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

# Contract suites that plugins subclass report readable assertion diffs.
pytest.register_assert_rewrite("polygateway.testing.contracts")

if TYPE_CHECKING:
    from polygateway.testing.fake_upstream import FakeUpstream


@pytest.fixture(scope="session")
def _pgw_fake_upstream_server() -> Iterator[FakeUpstream]:
    # Imported here: the plugin loads in every pytest run of an environment with the library.
    from polygateway.testing.fake_upstream import FakeUpstream

    with FakeUpstream.in_thread() as fake:
        yield fake


@pytest.fixture
def fake_upstream(_pgw_fake_upstream_server: FakeUpstream) -> Iterator[FakeUpstream]:
    """A running fake OpenAI-compatible upstream on 127.0.0.1, reset for this test."""
    _pgw_fake_upstream_server.reset()
    yield _pgw_fake_upstream_server
    _pgw_fake_upstream_server.reset()
