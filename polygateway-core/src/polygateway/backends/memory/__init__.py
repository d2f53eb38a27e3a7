"""In-process backends: limiter, breaker and cache for a single process.

Their semantics are the same as the shared (Redis) backends'; both run the contract suites of
``polygateway.testing.contracts``.
"""

from __future__ import annotations

from polygateway.backends.memory.breaker import InMemoryGate
from polygateway.backends.memory.limiter import InMemoryLimiter

__all__ = ["InMemoryGate", "InMemoryLimiter"]
