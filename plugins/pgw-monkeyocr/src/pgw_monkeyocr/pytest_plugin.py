"""pytest plugin (entry point ``pytest11``): the ``fake_monkeyocr`` fixture.

One fake MonkeyOCR server per test session, in its own thread so that it serves sync tests and
async tests on any event loop; every test gets it reset (scripts, settings, uploads, ZIPs).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pgw_monkeyocr.testing import FakeMonkeyOcr


@pytest.fixture(scope="session")
def _pgw_fake_monkeyocr_server() -> Iterator[FakeMonkeyOcr]:
    # Imported here: the plugin loads in every pytest run of an environment with the package.
    from pgw_monkeyocr.testing import FakeMonkeyOcr

    with FakeMonkeyOcr.in_thread() as fake:
        yield fake


@pytest.fixture
def fake_monkeyocr(_pgw_fake_monkeyocr_server: FakeMonkeyOcr) -> Iterator[FakeMonkeyOcr]:
    """A running fake MonkeyOCR server on 127.0.0.1, reset for this test."""
    _pgw_fake_monkeyocr_server.reset()
    yield _pgw_fake_monkeyocr_server
    _pgw_fake_monkeyocr_server.reset()
