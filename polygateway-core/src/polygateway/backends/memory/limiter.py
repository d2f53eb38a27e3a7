"""The in-process rate limiter: six gates, leases with a TTL, per-minute windows.

Admission (``try_acquire``) runs without a single ``await`` between checking the gates and
taking the slot, so it is atomic with respect to every other task on the event loop: that is
what makes it correct under asyncio concurrency without a lock.

Time: lease expiry and progress use ``clock.monotonic()``; RPM/TPM windows are fixed,
minute-aligned windows keyed by ``floor(clock.time() / 60)``, the same keying the Redis backend
uses with the server's time. Fixed windows admit up to twice a limit across a minute boundary;
that is the chosen trade-off for both backends.

Waiting for a slot (``acquire_queued``, ``ports.QueuedAdmission``): a call refused by a full
concurrency gate queues, first come first served, and a released (or expired) slot is handed to
the first waiter it admits before anyone else can take it; the caller does not poll. The wait
is bounded on the injected clock: the caller's timeout, and the oldest lease's expiry (a dead
holder frees its slot then, without a release).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import secrets
from collections import deque

from polygateway.backends import MAX_TOKENS, check_token_count
from polygateway.permits import OnceOnlyPermit
from polygateway.ports import Clock, Denial, Permit, SourceStats
from polygateway.settings import Limits
from polygateway.validation import check_limits

WINDOW_S = 60.0
"""Length of one RPM/TPM window."""

SLOT_WAIT_S = 1.0
"""Concurrency wait hint before any lease was released (no hold time observed yet)."""

MIN_SLOT_WAIT_S = 0.01
"""Floor of a concurrency wait hint: a zero would have callers re-ask in a tight loop."""

HOLD_WEIGHT = 0.2
"""Weight of the newest hold time in the running estimate (exponential moving average)."""

SLOT_GATES = frozenset({"global_concurrency", "source_concurrency"})
"""The gates a queued waiter waits on: a release frees them, time alone does not."""


def slot_wait(oldest_expiry_in_s: float, hold_s: float | None) -> float:
    """A full concurrency gate's wait hint: when a slot is likely to free.

    A slot frees when an in-flight call ends, which the gate cannot foresee; the typical hold
    time of released leases estimates it (``SLOT_WAIT_S`` before any release), and the oldest
    lease's expiry bounds it (a holder that died frees its slot then). The Redis backend
    computes the same in its acquire script."""
    estimate = SLOT_WAIT_S if hold_s is None else max(MIN_SLOT_WAIT_S, hold_s)
    return max(0.0, min(oldest_expiry_in_s, estimate))


def next_hold(previous: float | None, held_s: float) -> float:
    """The hold-time estimate after one more release."""
    if not held_s > 0.0:  # also NaN; a comparison, not max(): this runs on every release
        held_s = 0.0
    return held_s if previous is None else previous + HOLD_WEIGHT * (held_s - previous)


class _WindowUsage:
    """Requests and tokens charged to one key (the scope, or one source) in one window."""

    __slots__ = ("requests", "tokens", "window")

    def __init__(self) -> None:
        self.window = -1
        self.requests = 0
        self.tokens = 0
        """May go negative through ``settle``; readers clamp at 0."""


class _SourceState:
    __slots__ = ("hold_s", "leases", "usage")

    def __init__(self) -> None:
        # lease id -> expiry (monotonic). Insertion order is expiry order: the TTL is constant
        # and the clock is monotonic, so the earliest expiry is always the first entry. Plain
        # dicts (insertion-ordered) are about twice as fast as OrderedDict here; reaching the
        # first entry costs at most a scan over the slots freed since the last resize.
        self.leases: dict[int, float] = {}
        self.usage = _WindowUsage()
        self.hold_s: float | None = None
        """How long this source's leases are typically held (``None``: none released yet)."""


class _MemoryPermit(OnceOnlyPermit):
    """One admitted attempt. ``settle`` and ``release`` act once; later calls are no-ops."""

    __slots__ = ("_lease", "_limiter", "_state", "_window")

    def __init__(
        self,
        limiter: InMemoryLimiter,
        lease: int,
        source: str,
        state: _SourceState,
        est_tokens: int,
        window: int,
    ) -> None:
        super().__init__(source, est_tokens)
        self._limiter = limiter
        self._lease = lease
        self._state = state
        self._window = window

    @property
    def lease_id(self) -> str:
        # Leases are keyed by their number; the string id is made only when asked for.
        return f"{self._limiter._lease_prefix}{self._lease}"

    def _apply_settle(self, delta: int) -> None:
        self._limiter._adjust_tokens(self._state, self._window, delta)

    def _apply_release(self) -> None:
        # Absent when the lease already expired and was purged: then releasing is a no-op.
        lease = self._lease
        limiter = self._limiter
        if limiter._leases.pop(lease, None) is not None:
            expiry = self._state.leases.pop(lease)
            now = limiter._clock.monotonic()
            if expiry > now:  # an expired lease says nothing about how long calls take
                held = now - (expiry - limiter._lease_ttl_s)
                self._state.hold_s = next_hold(self._state.hold_s, held)
                limiter._hold_s = next_hold(limiter._hold_s, held)
            if limiter._waiters:
                limiter._serve_waiters()

    def release_now(self) -> None:
        """``release`` without a coroutine, for a permit nobody will use (a waiter that was
        cancelled after its slot was handed over)."""
        if not self._released:
            self._released = True
            self._apply_release()


class _Waiter:
    """One call queued for a concurrency slot (``acquire_queued``)."""

    __slots__ = ("deadline", "est_tokens", "future", "limits", "source")

    def __init__(
        self,
        source: str,
        est_tokens: int,
        limits: Limits,
        future: asyncio.Future[Permit | Denial | None],
        deadline: float,
    ) -> None:
        self.source = source
        self.est_tokens = est_tokens
        self.limits = limits
        self.future = future
        self.deadline = deadline
        """Set to the permit (or a non-slot refusal) by a release; ``None`` on the timeout."""


class InMemoryLimiter:
    """``ports.RateLimiter`` for one process.

    Gates, in order: global concurrency -> source concurrency -> global RPM -> source RPM ->
    global TPM -> source TPM. Concurrency/RPM refuse at ``used >= limit``, TPM at
    ``used + est > limit``; a limit of 0 disables its gate. A refusal changes nothing.

    Wait hints: RPM/TPM -> seconds to the end of the current window; concurrency -> the
    typical hold time of that gate's released leases, at most the time until its earliest
    lease expires (``slot_wait``): in-flight calls that finish in milliseconds give a hint in
    milliseconds, not the lease TTL.

    Counters are kept whether or not a gate is enabled, so ``source_stats`` always reports.
    """

    __slots__ = (
        "_clock",
        "_first_held",
        "_global_limits",
        "_global_usage",
        "_hold_s",
        "_keeper",
        "_keeper_wakes_at",
        "_lease_numbers",
        "_lease_prefix",
        "_lease_ttl_s",
        "_leases",
        "_progress_at",
        "_scope",
        "_serving",
        "_sources",
        "_waiters",
    )

    def __init__(
        self,
        *,
        global_limits: Limits,
        lease_ttl_s: float,
        clock: Clock,
        scope: str | None = None,
    ) -> None:
        """``scope``: the scope this limiter is built for (its sources are keyed by their bare
        names; another scope's sources by ``<scope>:<name>``). ``None``: the first scope
        whose client is assembled on it (``claim_scope``)."""
        check_limits(global_limits, "global_limits")
        if not (lease_ttl_s > 0.0 and math.isfinite(lease_ttl_s)):
            raise ValueError(f"lease_ttl_s must be a finite number > 0, got {lease_ttl_s!r}")
        self._global_limits = global_limits
        self._scope = scope
        self._lease_ttl_s = float(lease_ttl_s)
        self._clock = clock
        # lease number -> source state, scope-wide; insertion order is expiry order (see above).
        self._leases: dict[int, _SourceState] = {}
        self._sources: dict[str, _SourceState] = {}
        self._global_usage = _WindowUsage()
        self._progress_at: float | None = None
        self._hold_s: float | None = None
        # Unique, cheap lease ids: a random per-limiter prefix plus a counter (the number is
        # the key; the id string is built only when a permit's ``lease_id`` is read).
        self._lease_prefix = secrets.token_hex(4) + "-"
        self._lease_numbers = itertools.count(1)
        # No lease numbered below this is held: where the search for the oldest lease starts.
        self._first_held = 1
        self._waiters: deque[_Waiter] = deque()
        self._serving = False
        # One task watches the time for the whole line (deadlines, lease expiry), while
        # anyone waits: no timer per waiter.
        self._keeper: asyncio.Task[None] | None = None
        self._keeper_wakes_at = math.inf

    @property
    def global_limits(self) -> Limits:
        """The scope-wide gates' limits (every client sharing this limiter shares them)."""
        return self._global_limits

    def claim_scope(self, scope: str) -> str:
        """The owner scope: the one given at construction, else the first to claim it."""
        if self._scope is None:
            self._scope = scope
        return self._scope

    # ------------------------------------------------------------------ admission

    async def try_acquire(
        self, source: str, est_tokens: int, source_limits: Limits
    ) -> Permit | Denial:
        if type(est_tokens) is not int or not 0 <= est_tokens <= MAX_TOKENS:
            est_tokens = check_token_count(est_tokens, "est_tokens")
        # One bitwise OR tells whether any of the three limits is negative.
        if (source_limits.max_concurrency | source_limits.rpm | source_limits.tpm) < 0:
            check_limits(source_limits, "source_limits")
        return self._admit(source, est_tokens, source_limits)

    async def acquire_queued(
        self, source: str, est_tokens: int, source_limits: Limits, timeout_s: float
    ) -> Permit | Denial:
        """``try_acquire``, but a refusal by a concurrency gate waits in line for a slot, up
        to ``timeout_s`` (then the refusal of a last try); FIFO among waiters. Cancelled
        after a slot was handed over, the slot goes on to the next waiter."""
        if type(est_tokens) is not int or not 0 <= est_tokens <= MAX_TOKENS:
            est_tokens = check_token_count(est_tokens, "est_tokens")
        if (source_limits.max_concurrency | source_limits.rpm | source_limits.tpm) < 0:
            check_limits(source_limits, "source_limits")
        if not timeout_s >= 0:
            raise ValueError(f"timeout_s must be >= 0, got {timeout_s!r}")
        admitted = self._admit(source, est_tokens, source_limits)
        if not isinstance(admitted, Denial) or admitted.gate not in SLOT_GATES:
            return admitted
        deadline = self._clock.monotonic() + timeout_s
        handed = await self._wait_in_line(source, est_tokens, source_limits, deadline)
        if handed is not None:
            return handed
        return self._admit(source, est_tokens, source_limits)

    async def _wait_in_line(
        self, source: str, est_tokens: int, source_limits: Limits, deadline: float
    ) -> Permit | Denial | None:
        """Queue until a release hands this waiter a permit (or a non-slot refusal), or the
        clock reaches ``deadline`` (``None``)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Permit | Denial | None] = loop.create_future()
        waiter = _Waiter(source, est_tokens, source_limits, future, deadline)
        self._waiters.append(waiter)
        # A dead holder frees its slot at its lease's expiry, with no release to wake the
        # line: the keeper looks then too.
        wakes_at = min(deadline, self._oldest_expiry(source))
        if wakes_at < self._keeper_wakes_at:
            self._start_keeper(wakes_at)
        try:
            return await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                handed = future.result()
                if isinstance(handed, _MemoryPermit):
                    handed.release_now()  # ours but unused: on to the next waiter
            raise
        finally:
            # Still in line unless a release or the keeper took it off (and set its result).
            if future.cancelled():
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
            if not self._waiters:
                self._stop_keeper()

    def _start_keeper(self, wakes_at: float) -> None:
        """(Re)start the one task that watches the time for the whole line."""
        if self._keeper is not None:
            self._keeper.cancel()
        self._keeper_wakes_at = wakes_at
        self._keeper = asyncio.get_running_loop().create_task(self._keep_line(wakes_at))

    def _stop_keeper(self) -> None:
        if self._keeper is not None:
            self._keeper.cancel()
            self._keeper = None
        self._keeper_wakes_at = math.inf

    async def _keep_line(self, wakes_at: float) -> None:
        """The time-driven part of the line, one timer for every waiter: at a waiter's
        deadline it leaves the line with ``None``; at the oldest lease's expiry a dead
        holder's slot goes to the line (in order, like a release)."""
        clock = self._clock
        while True:
            await clock.sleep(max(0.0, wakes_at - clock.monotonic()))
            now = clock.monotonic()
            self._free_expired(now)
            waiters = self._waiters
            for waiter in waiters:
                if waiter.deadline <= now and not waiter.future.done():
                    waiter.future.set_result(None)
            if any(w.future.done() for w in waiters):
                self._waiters = waiters = deque(w for w in waiters if not w.future.done())
            if not waiters:
                self._keeper = None
                self._keeper_wakes_at = math.inf
                return
            wakes_at = min(min(w.deadline for w in waiters), self._oldest_expiry(waiters[0].source))
            self._keeper_wakes_at = wakes_at

    def _admit(self, source: str, est_tokens: int, source_limits: Limits) -> Permit | Denial:
        """The six gates and the charge, without an ``await`` (atomic on the event loop);
        the arguments are checked."""
        state = self._sources.get(source)
        if state is None:
            state = self._sources[source] = _SourceState()
        glimits = self._global_limits
        leases = self._leases
        now = self._clock.monotonic()

        # Expired leases are purged lazily, only when a concurrency gate looks full.
        limit = glimits.max_concurrency
        if limit and len(leases) >= limit:
            self._free_expired(now)
            if len(leases) >= limit:
                return Denial("global_concurrency", self._lease_wait(now, leases))
        limit = source_limits.max_concurrency
        if limit and len(state.leases) >= limit:
            self._free_expired(now)
            if len(state.leases) >= limit:
                return Denial("source_concurrency", self._source_lease_wait(now, state))

        wall = self._clock.time()
        window = int(wall // WINDOW_S)
        gusage = self._global_usage
        susage = state.usage
        # Rolling a counter into the new window is not a visible change: the old window is
        # never read again.
        if gusage.window != window:
            _roll(gusage, window)
        if susage.window != window:
            _roll(susage, window)

        limit = glimits.rpm
        if limit and gusage.requests >= limit:
            return Denial("global_rpm", (window + 1) * WINDOW_S - wall)
        limit = source_limits.rpm
        if limit and susage.requests >= limit:
            return Denial("source_rpm", (window + 1) * WINDOW_S - wall)
        limit = glimits.tpm
        if limit and gusage.tokens + est_tokens > limit:
            return Denial("global_tpm", (window + 1) * WINDOW_S - wall)
        limit = source_limits.tpm
        if limit and susage.tokens + est_tokens > limit:
            return Denial("source_tpm", (window + 1) * WINDOW_S - wall)

        lease = next(self._lease_numbers)
        leases[lease] = state
        state.leases[lease] = now + self._lease_ttl_s
        gusage.requests += 1
        gusage.tokens += est_tokens
        susage.requests += 1
        susage.tokens += est_tokens
        return _MemoryPermit(self, lease, source, state, est_tokens, window)

    # ------------------------------------------------------------------ introspection

    async def source_stats(self, source: str) -> SourceStats:
        state = self._sources.get(source)
        if state is None:
            return SourceStats(inflight=0, rpm_used=0, tpm_used=0)
        self._free_expired(self._clock.monotonic())
        usage = state.usage
        if usage.window != int(self._clock.time() // WINDOW_S):
            return SourceStats(inflight=len(state.leases), rpm_used=0, tpm_used=0)
        return SourceStats(
            inflight=len(state.leases), rpm_used=usage.requests, tpm_used=max(0, usage.tokens)
        )

    async def inflight(self) -> int:
        self._free_expired(self._clock.monotonic())
        return len(self._leases)

    async def mark_progress(self) -> None:
        self._progress_at = self._clock.monotonic()

    async def progress_age_s(self) -> float:
        if self._progress_at is None:
            return math.inf
        return max(0.0, self._clock.monotonic() - self._progress_at)

    async def aclose(self) -> None:
        """Stop the line's timer, if anyone waits; the state lives in this object."""
        self._stop_keeper()

    # ------------------------------------------------------------------ internals

    def _free_expired(self, now: float) -> None:
        """Drop the expired leases; the slots they held go to the waiters first."""
        if self._purge_expired(now) and self._waiters:
            self._serve_waiters()

    def _purge_expired(self, now: float) -> bool:
        """Drop the expired leases; whether there were any."""
        leases = self._leases
        purged = False
        while leases:
            lease_id = self._first_lease()
            state = leases[lease_id]
            if state.leases[lease_id] > now:
                return purged
            del leases[lease_id]
            del state.leases[lease_id]
            purged = True
        return purged

    def _serve_waiters(self) -> None:
        """Hand free slots to the waiters, in line order: each gets the permit (or the
        refusal of a gate other than concurrency, which waiting does not cure); one whose
        source gate is still full keeps its place. Stops when the global gate is full."""
        if self._serving:
            return  # a purge inside an admission below: this loop hands out what it frees
        self._serving = True
        try:
            waiters = self._waiters
            limit = self._global_limits.max_concurrency
            kept: list[_Waiter] = []
            while waiters and not (limit and len(self._leases) >= limit):
                waiter = waiters.popleft()
                if waiter.future.done():
                    continue  # timed out or cancelled, about to leave the line
                admitted = self._admit(waiter.source, waiter.est_tokens, waiter.limits)
                if isinstance(admitted, Denial) and admitted.gate in SLOT_GATES:
                    kept.append(waiter)
                    if admitted.gate == "global_concurrency":
                        break
                    continue
                waiter.future.set_result(admitted)
            waiters.extendleft(reversed(kept))
        finally:
            self._serving = False

    def _oldest_expiry(self, source: str) -> float:
        """When the next lease that blocks ``source`` expires (``inf``: none held)."""
        expiry = math.inf
        if self._leases:
            lease_id = self._first_lease()
            expiry = self._leases[lease_id].leases[lease_id]
        own = self._sources.get(source)
        if own is not None and own.leases:
            expiry = min(expiry, next(iter(own.leases.values())))
        return expiry

    def _first_lease(self) -> int:
        """The number of the oldest lease held (``_leases`` is not empty).

        Numbers grow with time and the TTL is constant, so the lowest number held is the
        earliest expiry. The search starts at the lowest number not yet known to be gone, and
        each number is passed over once: ``next(iter(...))`` over the dict would scan every
        slot freed since its last resize, on every look (a full gate looks several times per
        waiting call)."""
        leases = self._leases
        number = self._first_held
        while number not in leases:
            number += 1
        self._first_held = number
        return number

    def _lease_wait(self, now: float, leases: dict[int, _SourceState]) -> float:
        lease_id = self._first_lease()
        return slot_wait(leases[lease_id].leases[lease_id] - now, self._hold_s)

    def _source_lease_wait(self, now: float, state: _SourceState) -> float:
        return slot_wait(next(iter(state.leases.values())) - now, state.hold_s)

    def _adjust_tokens(self, state: _SourceState, window: int, delta: int) -> None:
        # The acquire-time window only: once it has rolled over nobody reads it again, so a
        # settle arriving later changes nothing visible (the Redis backend writes into the
        # old window's key, equally unread).
        if self._global_usage.window == window:
            self._global_usage.tokens += delta
        if state.usage.window == window:
            state.usage.tokens += delta

    def __repr__(self) -> str:
        return (
            f"InMemoryLimiter(global_limits={self._global_limits!r}, "
            f"lease_ttl_s={self._lease_ttl_s!r}, leases={len(self._leases)})"
        )


def _roll(usage: _WindowUsage, window: int) -> None:
    usage.window = window
    usage.requests = 0
    usage.tokens = 0
