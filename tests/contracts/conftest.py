"""The ``governance_backend`` fixture: every contract test runs once per available backend.

``memory`` always runs. A plugin joins by shipping a testing module with a factory and by
being listed in ``PLUGIN_BACKENDS`` below (one line): the param is added only when the
plugin's package is installed, and the factory receives the named fixtures' values as
positional arguments. For Redis::

    # pgw_redis/testing.py
    def make_governance_backend(redis_url: str, scope: str) -> GovernanceBackend:
        '''A backend on ``redis_url`` (tests use database 3) whose limiter and breaker keep
        all their state under ``scope`` (unique per test, from the ``unique_scope``
        fixture). ``supports_fake_time = False``, ``clock = UninjectableClock(...)``;
        ``cleanup()`` closes the instances it made and deletes every key under the scope.'''

``GovernanceBackend`` (``polygateway.testing.contracts``) documents the object's interface.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import AsyncIterator

import pytest

pytest.register_assert_rewrite("polygateway.testing.contracts")

from polygateway.testing.contracts import GovernanceBackend, MemoryGovernanceBackend  # noqa: E402

PLUGIN_BACKENDS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    # param: (testing module, factory name, fixtures passed to the factory in order)
    "redis": ("pgw_redis.testing", "make_governance_backend", ("redis_url", "unique_scope")),
}


def _backend_params() -> list[object]:
    params: list[object] = ["memory"]
    for name, (module, _, _) in PLUGIN_BACKENDS.items():
        # Installed package -> the param runs (an import error in its testing module then
        # fails loudly instead of silently dropping the backend).
        if importlib.util.find_spec(module.partition(".")[0]) is not None:
            params.append(pytest.param(name, marks=getattr(pytest.mark, name)))
    return params


@pytest.fixture(params=_backend_params())
async def governance_backend(request: pytest.FixtureRequest) -> AsyncIterator[GovernanceBackend]:
    backend: GovernanceBackend
    if request.param == "memory":
        backend = MemoryGovernanceBackend()
    else:
        module_name, factory_name, fixture_names = PLUGIN_BACKENDS[request.param]
        args = [request.getfixturevalue(name) for name in fixture_names]
        factory = getattr(importlib.import_module(module_name), factory_name)
        backend = factory(*args)
    try:
        yield backend
    finally:
        await backend.cleanup()
