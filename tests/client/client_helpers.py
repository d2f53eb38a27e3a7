"""Test doubles implementing the ports, and builders, shared by the client tests.

The doubles implement the public ports (Transport, RateLimiter, ProviderGate, CallObserver);
nothing of the library's internals is patched.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from polygateway.backends.memory.breaker import InMemoryGate
from polygateway.backends.memory.limiter import InMemoryLimiter
from polygateway.chat import ChatDispatcher
from polygateway.context import CallContext
from polygateway.errors import GovernanceBackendError
from polygateway.ports import (
    Denial,
    GateDecision,
    GateUpdate,
    Permit,
    SourceStats,
)
from polygateway.selectors import RoundRobinSelector
from polygateway.settings import (
    BackpressureSettings,
    BreakerSettings,
    Limits,
    RetrySettings,
    SourceConfig,
)
from polygateway.testing import FakeClock
from polygateway.types import ChatRequest, LLMResponse, TransportResult

MESSAGES = [{"role": "user", "content": "hello"}]


def source(name: str, **overrides: Any) -> SourceConfig:
    values: dict[str, Any] = {
        "name": name,
        "provider": "openai",
        "base_url": f"http://unused.invalid/{name}/v1",
        "model": f"model-{name}",
        "timeout_s": 10.0,
        "est_tokens": 10,
    }
    values.update(overrides)
    return SourceConfig(**values)


# --------------------------------------------------------------------------- transport


Step = TransportResult | BaseException | Callable[[], Any]


class ScriptedTransport:
    """Per source, a FIFO of outcomes: a result, an exception to raise, or an async callable.

    When a source's script is empty it answers ``ok()``.
    """

    def __init__(self) -> None:
        self.scripts: dict[str, deque[Step]] = defaultdict(deque)
        self.calls: list[tuple[str, str]] = []  # (source, call_id)
        self.requests: list[ChatRequest] = []
        self.closed = False

    def script(self, name: str, *steps: Step) -> None:
        self.scripts[name].extend(steps)

    def count(self, name: str | None = None) -> int:
        return sum(1 for s, _ in self.calls if name is None or s == name)

    async def send(
        self, request: ChatRequest, source: SourceConfig, *, call_id: str
    ) -> TransportResult:
        self.calls.append((source.name, call_id))
        self.requests.append(request)
        script = self.scripts[source.name]
        step: Step = script.popleft() if script else ok()
        if isinstance(step, BaseException):
            raise step
        if callable(step):
            return await step()  # type: ignore[no-any-return]
        return step

    async def aclose(self) -> None:
        self.closed = True


def ok(content: str = "fine", prompt: int = 3, completion: int = 4) -> TransportResult:
    return TransportResult(
        content=content,
        model="served-model",
        prompt_tokens=prompt,
        completion_tokens=completion,
        latency_ms=5,
        ttft_ms=1.0,
        max_inter_token_ms=2.0,
        finish_reason="stop",
    )


# --------------------------------------------------------------------------- observer


@dataclass
class RecordingObserver:
    attempts: list[tuple[str, str, Any, int]] = field(default_factory=list)
    invalid: list[str] = field(default_factory=list)

    def on_attempt(
        self,
        request: ChatRequest,
        source: SourceConfig,
        call_id: str,
        outcome: LLMResponse | BaseException,
        latency_ms: int,
    ) -> None:
        self.attempts.append((source.name, call_id, outcome, latency_ms))

    def on_result_invalid(self, call_id: str, error: BaseException) -> None:
        self.invalid.append(call_id)


# --------------------------------------------------------------------------- governance doubles


class ScriptedLimiter:
    """A limiter that refuses until ``admit_after`` (monotonic), with a scripted progress age.

    ``progress_age`` maps the clock's monotonic time to the age it reports.
    """

    def __init__(
        self,
        clock: FakeClock,
        *,
        admit_after: float = math.inf,
        wait_s: float = 1.0,
        gate: str = "global_concurrency",
        progress_age: Callable[[float], float] = lambda now: math.inf,
    ) -> None:
        self.clock = clock
        self.admit_after = admit_after
        self.wait_s = wait_s
        self.gate = gate
        self.progress_age = progress_age
        self.inner = InMemoryLimiter(global_limits=Limits(), lease_ttl_s=60.0, clock=clock)
        self.acquire_calls = 0
        self.progress_age_calls: list[float] = []

    async def try_acquire(self, source: str, est_tokens: int, source_limits: Limits) -> Any:
        self.acquire_calls += 1
        if self.clock.monotonic() < self.admit_after:
            return Denial(self.gate, self.wait_s)  # type: ignore[arg-type]
        return await self.inner.try_acquire(source, est_tokens, source_limits)

    async def source_stats(self, source: str) -> SourceStats:
        return await self.inner.source_stats(source)

    async def inflight(self) -> int:
        return await self.inner.inflight()

    async def mark_progress(self) -> None:
        await self.inner.mark_progress()

    async def progress_age_s(self) -> float:
        now = self.clock.monotonic()
        self.progress_age_calls.append(now)
        return self.progress_age(now)

    async def aclose(self) -> None:
        pass


class FaultyLimiter:
    """Wraps a real limiter; selected methods raise ``GovernanceBackendError``.

    ``admission`` faults ``try_acquire``/``progress_age_s``; ``accounting`` faults the
    permit's ``settle``/``release`` and ``mark_progress`` (they still reach the real limiter
    first for ``release``, so no lease leaks in the test).
    """

    def __init__(
        self, inner: InMemoryLimiter, *, admission: bool = False, accounting: bool = False
    ):
        self.inner = inner
        self.admission = admission
        self.accounting = accounting
        self.closed = False

    async def try_acquire(self, source: str, est_tokens: int, source_limits: Limits) -> Any:
        if self.admission:
            raise GovernanceBackendError("limiter backend unreachable (scripted)")
        admitted = await self.inner.try_acquire(source, est_tokens, source_limits)
        if isinstance(admitted, Denial) or not self.accounting:
            return admitted
        return _FaultyPermit(admitted)

    async def source_stats(self, source: str) -> SourceStats:
        return await self.inner.source_stats(source)

    async def inflight(self) -> int:
        return await self.inner.inflight()

    async def mark_progress(self) -> None:
        if self.accounting:
            raise GovernanceBackendError("mark_progress failed (scripted)")
        await self.inner.mark_progress()

    async def progress_age_s(self) -> float:
        if self.admission:
            raise GovernanceBackendError("progress_age_s failed (scripted)")
        return await self.inner.progress_age_s()

    async def aclose(self) -> None:
        self.closed = True


class _FaultyPermit:
    def __init__(self, inner: Permit) -> None:
        self.inner = inner

    @property
    def lease_id(self) -> str:
        return self.inner.lease_id

    @property
    def source(self) -> str:
        return self.inner.source

    @property
    def est_tokens(self) -> int:
        return self.inner.est_tokens

    async def settle(self, actual_tokens: int) -> None:
        raise GovernanceBackendError("settle failed (scripted)")

    async def release(self) -> None:
        await self.inner.release()
        raise GovernanceBackendError("release failed (scripted)")


class FaultyBreaker:
    """Wraps a real breaker; ``admission`` faults ``try_enter``/``retry_after_s``, ``accounting``
    faults ``record_*``/``release_probe``."""

    def __init__(self, inner: InMemoryGate, *, admission: bool = False, accounting: bool = False):
        self.inner = inner
        self.admission = admission
        self.accounting = accounting
        self.entered: list[str] = []
        self.closed = False

    async def try_enter(self, source: str) -> GateDecision:
        self.entered.append(source)
        if self.admission:
            raise GovernanceBackendError("breaker backend unreachable (scripted)")
        return await self.inner.try_enter(source)

    async def record_success(self, decision: GateDecision) -> GateUpdate:
        if self.accounting:
            raise GovernanceBackendError("record_success failed (scripted)")
        return await self.inner.record_success(decision)

    async def record_failure(
        self, decision: GateDecision, *, threshold: int | None = None, force_open: bool = False
    ) -> GateUpdate:
        if self.accounting:
            raise GovernanceBackendError("record_failure failed (scripted)")
        return await self.inner.record_failure(decision, threshold=threshold, force_open=force_open)

    async def release_probe(self, decision: GateDecision) -> None:
        if self.accounting:
            raise GovernanceBackendError("release_probe failed (scripted)")
        await self.inner.release_probe(decision)

    async def force_open(self, source: str) -> GateUpdate:
        return await self.inner.force_open(source)

    async def state(self, source: str) -> Any:
        return await self.inner.state(source)

    async def retry_after_s(self, sources: Sequence[str]) -> float:
        if self.admission:
            raise GovernanceBackendError("retry_after_s failed (scripted)")
        return await self.inner.retry_after_s(sources)

    async def aclose(self) -> None:
        self.closed = True


# --------------------------------------------------------------------------- builder


@dataclass
class Rig:
    """The chat dispatcher (on the governor) over scripted transports, real memory backends
    and a fake clock."""

    layer: ChatDispatcher
    transport: ScriptedTransport
    limiter: Any
    breaker: Any
    clock: FakeClock
    sources: tuple[SourceConfig, ...]
    observer: RecordingObserver

    async def call(self, messages: Sequence[Mapping[str, Any]] = MESSAGES) -> LLMResponse:
        context = CallContext()
        context.add_observer(self.observer)
        return await self.layer(ChatRequest(messages=messages, context=context))


def make_rig(
    names: Iterable[str] = ("a", "b"),
    *,
    sources: Sequence[SourceConfig] | None = None,
    retry: RetrySettings | None = None,
    breaker_settings: BreakerSettings | None = None,
    backpressure: BackpressureSettings | None = None,
    global_limits: Limits | None = None,
    limiter: Any = None,
    breaker: Any = None,
    selector: Any = None,
    clock: FakeClock | None = None,
    seed: int = 7,
) -> Rig:
    clock = clock or FakeClock()
    srcs = tuple(sources) if sources is not None else tuple(source(n) for n in names)
    breaker_settings = breaker_settings or BreakerSettings(fail_threshold=3, cooldown_s=30.0)
    transport = ScriptedTransport()
    limiter = limiter or InMemoryLimiter(
        global_limits=global_limits or Limits(), lease_ttl_s=60.0, clock=clock
    )
    breaker = breaker or InMemoryGate(
        fail_threshold=breaker_settings.fail_threshold,
        cooldown_s=breaker_settings.cooldown_s,
        probe_ttl_s=60.0,
        clock=clock,
    )
    layer = ChatDispatcher.create(
        sources=srcs,
        transports={s.name: transport for s in srcs},
        limiter=limiter,
        breaker=breaker,
        selector=selector or RoundRobinSelector(),
        retry=retry or RetrySettings(max_attempts=3, base_delay_s=1.0, max_delay_s=30.0),
        breaker_settings=breaker_settings,
        backpressure=backpressure or BackpressureSettings(stall_window_s=300.0),
        clock=clock,
        rng=random.Random(seed),
    )
    return Rig(layer, transport, limiter, breaker, clock, srcs, RecordingObserver())


async def wait_until(predicate: Callable[[], bool], *, timeout: float = 5.0) -> None:
    """Yield to the loop until ``predicate()`` holds (no fixed sleeps)."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0)


# --------------------------------------------------------------------------- clients on the fake


def registry() -> Any:
    """The builtin plugin only: fast and independent of what else is installed."""
    from polygateway.plugins import load_registry

    return load_registry(autoload=False)


def http_settings(
    fake: Any,
    names: Iterable[str] = ("a", "b"),
    *,
    source_overrides: Mapping[str, Mapping[str, Any]] | None = None,
    scope: str = "LLM",
    **scope_overrides: Any,
) -> Any:
    """Scope settings whose sources point at ``fake``; cache and telemetry off by default."""
    from polygateway.settings import CacheSettings, ScopeSettings, TelemetrySettings

    overrides = source_overrides or {}
    sources = tuple(
        source(n, base_url=fake.base_url(n), **dict(overrides.get(n, {}))) for n in names
    )
    values: dict[str, Any] = {
        "scope": scope,
        "sources": sources,
        "cache": CacheSettings(backend="none"),
        "telemetry": TelemetrySettings(backend="none"),
        "breaker": BreakerSettings(fail_threshold=3, cooldown_s=30.0),
    }
    values.update(scope_overrides)
    return ScopeSettings(**values)


def http_client(
    fake: Any,
    names: Iterable[str] = ("a", "b"),
    *,
    clock: Any = None,
    source_overrides: Mapping[str, Mapping[str, Any]] | None = None,
    injected: Mapping[str, Any] | None = None,
    **scope_overrides: Any,
) -> Any:
    from polygateway.client import GatewayClient

    settings = http_settings(fake, names, source_overrides=source_overrides, **scope_overrides)
    return GatewayClient(settings, registry=registry(), clock=clock, **dict(injected or {}))
