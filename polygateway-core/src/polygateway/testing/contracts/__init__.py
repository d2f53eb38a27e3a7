"""Contract suites every governance backend passes, whatever stores its state.

The suites are plain pytest classes; subclass one in a test module and provide a
``governance_backend`` fixture (directly, or from a ``conftest.py``)::

    from polygateway.testing.contracts import BreakerContract, LimiterContract

    class TestLimiterContract(LimiterContract):
        pass

    class TestBreakerContract(BreakerContract):
        pass

The fixture returns an object implementing :class:`GovernanceBackend`: factories for a fresh
limiter and breaker whose state no other test shares, the clock that drives them, and
``cleanup``. A backend whose time cannot be injected (Redis uses the server's ``TIME``)
sets ``supports_fake_time = False`` and ``clock = UninjectableClock()``: the time-dependent
tests then skip, and the backend covers them with real-wait variants of its own.
"""

from __future__ import annotations

from typing import Any, NoReturn, Protocol, runtime_checkable

import pytest

from polygateway.ports import ProviderGate, RateLimiter
from polygateway.settings import Limits
from polygateway.testing.clock import FakeClock
from polygateway.testing.contracts.breaker import BreakerContract
from polygateway.testing.contracts.cache import CacheContract
from polygateway.testing.contracts.limiter import LimiterContract
from polygateway.testing.contracts.middleware import MiddlewareContract
from polygateway.testing.contracts.telemetry import (
    TelemetryRecorderContract,
    assert_row_matches,
    sample_record,
)
from polygateway.testing.contracts.transport import TransportContract


@runtime_checkable
class GovernanceBackend(Protocol):
    """What the ``governance_backend`` fixture returns.

    - ``make_limiter(global_limits=..., lease_ttl_s=...)`` and
      ``make_breaker(fail_threshold=..., cooldown_s=..., probe_ttl_s=...)`` are called with
      keyword arguments and return a new instance (synchronously). Instances made by one
      backend object must not share state with any other test (Redis: a unique scope).
      A test makes at most one limiter and one breaker.
    - ``clock``: the clock the instances run on. With ``supports_fake_time`` it must have
      ``advance(seconds)`` (``FakeClock``); otherwise use ``UninjectableClock``.
    - ``cleanup()``: awaited after each test; closes what the factories made and removes
      any state they left behind.
    - Optional ``async window_time() -> float``: the wall time (seconds) that keys the RPM/TPM
      windows. Only consulted when ``supports_fake_time`` is false, to keep a test clear of a
      minute boundary; when absent the local ``time.time()`` is used.
    """

    supports_fake_time: bool

    @property
    def clock(self) -> Any: ...

    def make_limiter(self, *, global_limits: Limits, lease_ttl_s: float) -> RateLimiter: ...

    def make_breaker(
        self,
        *,
        fail_threshold: int,
        cooldown_s: float,
        probe_ttl_s: float,
        max_cooldown_s: float | None = None,
    ) -> ProviderGate: ...

    async def cleanup(self) -> None: ...


class UninjectableClock:
    """Stands in for the clock of a backend whose time is not injectable.

    Calling ``advance`` skips the running test: it depends on moving time, which only a
    real-wait variant in the backend's own suite can cover.
    """

    __slots__ = ("_reason",)

    def __init__(
        self,
        reason: str = "time-dependent: covered by the real-wait variant in the backend's suite",
    ) -> None:
        self._reason = reason

    def advance(self, seconds: float) -> NoReturn:
        pytest.skip(self._reason)

    @property
    def reason(self) -> str:
        return self._reason


class MemoryGovernanceBackend:
    """The in-process backends on a shared ``FakeClock``."""

    supports_fake_time = True

    def __init__(self, clock: FakeClock | None = None) -> None:
        self.clock = clock if clock is not None else FakeClock()

    def make_limiter(self, *, global_limits: Limits, lease_ttl_s: float) -> RateLimiter:
        from polygateway.backends.memory.limiter import InMemoryLimiter

        return InMemoryLimiter(
            global_limits=global_limits, lease_ttl_s=lease_ttl_s, clock=self.clock
        )

    def make_breaker(
        self,
        *,
        fail_threshold: int,
        cooldown_s: float,
        probe_ttl_s: float,
        max_cooldown_s: float | None = None,
    ) -> ProviderGate:
        from polygateway.backends.memory.breaker import InMemoryGate

        return InMemoryGate(
            fail_threshold=fail_threshold,
            cooldown_s=cooldown_s,
            probe_ttl_s=probe_ttl_s,
            clock=self.clock,
            max_cooldown_s=max_cooldown_s,
        )

    async def cleanup(self) -> None:
        """Nothing outlives the test: state lives in the instances."""


__all__ = [
    "BreakerContract",
    "CacheContract",
    "GovernanceBackend",
    "LimiterContract",
    "MemoryGovernanceBackend",
    "MiddlewareContract",
    "TelemetryRecorderContract",
    "TransportContract",
    "UninjectableClock",
    "assert_row_matches",
    "sample_record",
]
