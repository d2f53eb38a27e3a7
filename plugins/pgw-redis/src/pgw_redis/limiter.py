"""The shared rate limiter: six gates in one Lua script, state in Redis (M2 §2).

Semantics are the in-memory limiter's (``ports.RateLimiter``): gates in order global
concurrency -> source concurrency -> global RPM -> source RPM -> global TPM -> source TPM;
concurrency and RPM refuse at ``used >= limit``, TPM at ``used + est > limit``; 0 disables a
gate; a refusal changes nothing but dropping expired leases. What differs is where the state
lives: every process using the same Redis and scope shares it.

Time: windows and lease expiry use the Redis server's clock (``TIME`` in the scripts), never
the hosts'. The caller names the window key it expects (so every key is declared, as Redis
Cluster requires) from a local estimate of the server clock; the script refuses a wrong guess
with the server time, and the call is repeated once with the corrected window. The estimate
is learned from every reply, so the repeat happens only around minute boundaries.

Round trips: admissions (``try_acquire``, and ``enter_and_acquire``, which runs a
``RedisGate``'s ``try_enter`` of the same scope and server in the same script) are queued and
sent at the next turn of the event loop in calls of the ``BATCH`` script: ``SMALL_BATCH_ADMISSIONS``
a call, or an eighth of those waiting when that is more (a burst goes in a few round trips).
Up to ``MAX_BATCHES_IN_FLIGHT`` batches of admissions are on the wire at once (each on its own
connection), so an admission does not wait for the reply of a batch it missed; what arrives
while that many are in flight goes in the next. Each admission in a batch is decided as it
would be alone, in order. Batches on two connections may run in either order on the server:
each call's writes are queued only after its admission's reply (a release never overtakes its
acquire), and an acquire that overtakes a release sees one lease too many, so at worst it
refuses early, never admits too much. Reads are one round trip each. Accounting
(``settle``, ``release``, ``mark_progress``) never raises and never waits for Redis: it is
queued and sent in front of the next batch of admissions, or by a background flush as soon as
the caller yields to the event loop. A permit settled and then
released in the same turn costs one script (``release`` applies the TPM correction), and a
progress mark rides along with a release. Reads (``inflight``, ``source_stats``,
``progress_age_s``) see every write queued before them; an admission may not see a release
still on the wire, so at worst it refuses early, never admits too much. ``flush()`` (and
``aclose()``) waits until everything queued has been sent and every batch on the wire has
landed. A process that dies with writes queued loses them; the lease TTL frees its leases, as
it does after a SIGKILL. ``aclose()`` refuses admissions from its first step on.

Size: one script call carries at most ``MAX_BATCH_ACCOUNTING`` writes and
``MAX_BATCH_ADMISSIONS`` admissions. Redis runs a script atomically, serving no other client
meanwhile, so a backlog (the compensations of an outage) goes out in bounded pieces, one call
after the other, and an admission carries one piece at most in front of it.

Queued writes are never lost to someone else's trouble: when the command they ride with is
cancelled or fails (waiting for a connection, connecting, a connection lost, a timeout), they
go back to the queue and the background flush sends them. Whether they ran
before the failure is often unknowable, so every accounting script is idempotent: a release
removes a lease id (twice is once), and a lease's TPM correction is applied only by the run
that records its id in the window's set of settled leases. When the background flush (or
``flush()``) fails they are kept and sent again in the background, with a backoff from
``RETRY_FIRST_S`` up to ``RETRY_MAX_S``, until they land: a compensation that is dropped leaves
a lease that nobody releases (an acquire sent before Redis froze runs when it thaws), and with
a small concurrency limit the scope would refuse every call until the lease expires. Retrying is
bounded: after ``max(RETRY_FOR_S, 2 * lease_ttl_s)`` of failures in a row the writes are dropped
with a warning (the leases expire after their TTL), and ``aclose()`` stops the retries.

Cancellation: lease ids are made here before the script is sent. If the caller is cancelled
(or the connection fails) after sending, the script may have run, or may still run (the
command can sit in the server's input while the compensation arrives on another connection).
A queued compensation therefore releases the lease and refunds its TPM pre-charge when the
lease exists, and otherwise records the id as abandoned so that the acquire, should it run
afterwards, admits nothing. redis-py drops the connection of a cancelled command, so it is
never a reply behind. Batches are sent by the limiter's own flush task, which a cancelled
caller does not cancel; an admission cancelled while still queued is taken off the queue, or left
out by the batch that would have taken it (it was never sent: nothing to compensate). Nor is
anything compensated when the batch failed before it was written (no connection, no free
slot: ``NotSentError``). A batch that fails in any other way, expected or not, fails each of
its admissions with a ``GovernanceBackendError`` of its own. Batches run in a context of their
own, not in that of the caller who happened to queue first.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
import time
from collections.abc import Callable, Sequence
from functools import partial
from itertools import islice
from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING, Any, Final, Literal, TypeAlias

from polygateway.errors import GovernanceBackendError
from polygateway.permits import OnceOnlyPermit
from polygateway.ports import (
    Clock,
    Denial,
    GateDecision,
    JointAdmit,
    Permit,
    ProviderGate,
    SourceStats,
)
from polygateway.settings import Limits
from polygateway.validation import MAX_TOKENS, check_limits, check_token_count, check_ttl
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError

from pgw_redis._warn import WarnOnce
from pgw_redis.connection import (
    BACKEND_ERRORS,
    AnyCall,
    EncodedInts,
    NotSentError,
    PackedCall,
    RedisClient,
    ScriptCall,
    ScriptClient,
    bulk,
)
from pgw_redis.keys import LimiterKeys, SourceKeys, new_lease_id
from pgw_redis.scripts import (
    BATCH,
    BATCH_ARG_COUNTS,
    BATCH_REPLY_FIELDS,
    INFLIGHT,
    PROGRESS_AGE,
    SOURCE_STATS,
)

if TYPE_CHECKING:
    from pgw_redis.breaker import RedisGate

logger = logging.getLogger(__name__)

WINDOW_MS: Final = 60_000

GateName: TypeAlias = Literal[
    "global_concurrency",
    "source_concurrency",
    "global_rpm",
    "source_rpm",
    "global_tpm",
    "source_tpm",
]

_GATES: Final[tuple[GateName, ...]] = (
    "global_concurrency",
    "source_concurrency",
    "global_rpm",
    "source_rpm",
    "global_tpm",
    "source_tpm",
)

_WINDOW_ATTEMPTS = 3
"""Tries with a corrected window id before giving up (each retry follows a minute boundary)."""

RETRY_FIRST_S: Final = 0.05
"""First wait before queued accounting that failed is sent again (doubling from there)."""

RETRY_MAX_S: Final = 0.5
"""Longest wait between two retries: a recovered Redis gets the writes within this."""

RETRY_FOR_S: Final = 60.0
"""Least time queued accounting is retried through an outage (at least twice the lease TTL)."""

MAX_BATCH_ADMISSIONS: Final = 256
"""Admissions sent in one script call at most; more wait for the next one."""

SMALL_BATCH_ADMISSIONS: Final = 8
"""Admissions sent in one script call, unless an eighth of those waiting is more.

The callers of a batch all resume in one turn of the event loop, and each allocates its
request (about 60 objects the garbage collector tracks, most of them the HTTP client's) before
it waits again. Past 700 of them the collector runs a young collection, which walks every call
in flight; the calls that finish meanwhile do not offset it (the collector's count stops at
zero). Batches of 8 keep a wave under that, as calls admitted one by one are (measured at
concurrency 64: 37 young collections per 1000 calls with batches of about 16, 9 with batches
of 8; ``tools/bench/RESULTS.md``). Two of them in flight still admit 16 callers a round trip.
A burst takes an eighth of the queue a call (at most ``MAX_BATCH_ADMISSIONS``): a thousand
callers wait about fifteen round trips, not sixty-four."""

BURST_SHARE: Final = 8
"""A script call takes at least ``1/BURST_SHARE`` of the admissions waiting."""

MAX_BATCH_ACCOUNTING: Final = 256
"""Accounting operations sent in one script call at most: a backlog (after an outage) goes
in several calls, so that no call keeps Redis from its other clients for long and an
admission never waits behind more than this many writes."""

MAX_BATCHES_IN_FLIGHT: Final = 2
"""Batches of admissions on the wire at once (each on a connection of its own)."""

_Op: TypeAlias = tuple[int, bytes, int, bytes]
"""One operation of a batch, encoded (``connection.bulk``): its key count, its keys, its
argument count and its arguments, its code (the BATCH script's) included; ``_batch_call``
appends where its keys start."""


# Operations of the BATCH script: code, keys, arguments (see scripts.BATCH). An operation's
# arguments are its code and its script's own; _batch_call appends where its keys start.
_ACQUIRE_KEYS: Final = 9
_ACQUIRE_ARGS: Final = 1 + BATCH_ARG_COUNTS[1]
_ACQUIRE_HEAD: Final = bulk(1)
_GATE_ACQUIRE_KEYS: Final = 1 + _ACQUIRE_KEYS
_GATE_ACQUIRE_ARGS: Final = 1 + BATCH_ARG_COUNTS[6]
_GATE_ACQUIRE_HEAD: Final = bulk(6)
_RELEASE_KEYS: Final = 9
_RELEASE_ARGS: Final = 1 + BATCH_ARG_COUNTS[2]
_RELEASE_HEAD: Final = bulk(2)
_SETTLE_KEYS: Final = 3
_SETTLE_ARGS: Final = 1 + BATCH_ARG_COUNTS[3]
_SETTLE_HEAD: Final = bulk(3)
_PROGRESS_HEAD: Final = bulk(4)
_ACQUIRE_FIELDS: Final = BATCH_REPLY_FIELDS[1]
_GATE_FIELDS: Final = BATCH_REPLY_FIELDS[5]
_JOINT_FIELDS: Final = BATCH_REPLY_FIELDS[6]
_TRUE: Final = bulk(1)
_FALSE: Final = bulk(0)
_UNKNOWN_TIME: Final = bulk(0)
"""A release's acquire time when it is not known (a compensation's): no hold time is taken."""

_arg_count = itemgetter(2)
_op_of = attrgetter("op")


def _batch_call(ops: Sequence[_Op], ints: EncodedInts) -> PackedCall:
    """Every operation of ``ops`` as one call of the BATCH script (they run in order).

    Operations on the same keys (one source's, in one window: the same encoded bytes) send
    them once, and each operation says where its keys start: the server converts every
    argument it receives, so ten keys repeated by each operation cost it more than the
    operation's own work."""
    offsets: dict[bytes, bytes] = {}
    key_count = 0
    args: list[bytes] = []
    for op_key_count, op_keys, _op_arg_count, op_args in ops:
        offset = offsets.get(op_keys)
        if offset is None:
            offset = offsets[op_keys] = ints[key_count]
            key_count += op_key_count
        args.append(op_args)
        args.append(offset)
    return PackedCall(
        BATCH,
        key_count,
        b"".join(offsets),
        sum(map(_arg_count, ops)) + len(ops),
        b"".join(args),
    )


class _SourceWindow:
    """The keys of one source's operations in one window, encoded once: every admission,
    settle and release of the source in that minute sends the same ones. So are the window's
    arguments, and the limits of the last ``source_limits`` seen."""

    __slots__ = (
        "_fixed",
        "_gate_key",
        "_ints",
        "_joint_keys",
        "_limits",
        "_limits_args",
        "acquire_keys",
        "release_keys",
        "settle_keys",
        "window",
        "window_arg",
        "window_end_arg",
    )

    def __init__(
        self,
        keys: LimiterKeys,
        source_keys: SourceKeys,
        window: int,
        fixed: tuple[int, Limits],
        ints: EncodedInts,
    ) -> None:
        w = str(window)
        self._ints = ints
        self.window = window
        self.window_arg = bulk(window)
        self.window_end_arg = bulk((window + 1) * (WINDOW_MS // 1000))
        self.acquire_keys = b"".join(
            map(
                bulk,
                (
                    keys.lease,
                    source_keys.lease,
                    keys.rpm_base + w,
                    source_keys.rpm_base + w,
                    keys.tpm_base + w,
                    source_keys.tpm_base + w,
                    keys.abandoned,
                    keys.hold,
                    source_keys.hold,
                ),
            )
        )
        self.release_keys = b"".join(
            map(
                bulk,
                (
                    keys.lease,
                    source_keys.lease,
                    keys.tpm_base + w,
                    source_keys.tpm_base + w,
                    keys.progress,
                    keys.abandoned,
                    keys.settled_base + w,
                    keys.hold,
                    source_keys.hold,
                ),
            )
        )
        self.settle_keys = b"".join(
            map(bulk, (keys.tpm_base + w, source_keys.tpm_base + w, keys.settled_base + w))
        )
        self._fixed = fixed
        self._gate_key = ""
        self._joint_keys = b""
        self._limits: Limits | None = None
        self._limits_args = b""

    def acquire_op(self, lease_arg: bytes, est_tokens: int, source_limits: Limits) -> _Op:
        """The acquire operation (``lease_arg``: the lease id, encoded)."""
        if source_limits is not self._limits:
            self._encode_limits(source_limits)
        return (
            _ACQUIRE_KEYS,
            self.acquire_keys,
            _ACQUIRE_ARGS,
            b"%b%b%b%b%b"
            % (
                _ACQUIRE_HEAD,
                self.window_arg,
                lease_arg,
                self._ints[est_tokens],
                self._limits_args,
            ),
        )

    def joint_op(
        self,
        gate_key: str,
        enter_args: bytes,
        lease_arg: bytes,
        est_tokens: int,
        source_limits: Limits,
    ) -> _Op:
        """The gate_acquire operation: the gate's try_enter (``enter_args``: its arguments
        after the probe owner id, which is the lease id), then the acquire."""
        if source_limits is not self._limits:
            self._encode_limits(source_limits)
        if gate_key != self._gate_key:
            self._joint_keys = bulk(gate_key) + self.acquire_keys
            self._gate_key = gate_key
        return (
            _GATE_ACQUIRE_KEYS,
            self._joint_keys,
            _GATE_ACQUIRE_ARGS,
            b"%b%b%b%b%b%b%b"
            % (
                _GATE_ACQUIRE_HEAD,
                lease_arg,
                enter_args,
                self.window_arg,
                lease_arg,
                self._ints[est_tokens],
                self._limits_args,
            ),
        )

    def _encode_limits(self, source_limits: Limits) -> None:
        lease_ttl_ms, glimits = self._fixed
        self._limits_args = b"".join(
            map(
                bulk,
                (
                    lease_ttl_ms,
                    glimits.max_concurrency,
                    source_limits.max_concurrency,
                    glimits.rpm,
                    source_limits.rpm,
                    glimits.tpm,
                    source_limits.tpm,
                ),
            )
        )
        self._limits = source_limits


class _Admission:
    """An admission waiting for the next batch: its operation, its caller's future, and
    whether it is a gate_acquire (its reply: the gate's fields and the acquire's).

    The future's result is the batch's whole flat reply; ``at`` is where this admission's
    fields start in it."""

    __slots__ = ("at", "future", "joint", "op", "sent")

    def __init__(self, op: _Op, future: asyncio.Future[Any], joint: bool) -> None:
        self.op = op
        self.future = future
        self.joint = joint
        self.sent = False
        self.at = 0


class _QueuedAccounting:
    """What is queued for one lease: a TPM correction, a release, or both (one script).
    ``acquired_arg``: the server time its acquire answered, encoded (``_UNKNOWN_TIME`` for a
    compensation's), from which the release tells how long the lease was held."""

    __slots__ = (
        "acquired_arg",
        "compensation",
        "delta",
        "keys",
        "lease_arg",
        "lease_id",
        "release",
    )

    def __init__(
        self, lease_id: str, lease_arg: bytes, keys: _SourceWindow, acquired_arg: bytes
    ) -> None:
        self.lease_id = lease_id
        self.lease_arg = lease_arg
        self.keys = keys
        self.acquired_arg = acquired_arg
        self.delta = 0
        self.release = False
        self.compensation = False

    def absorb(self, later: _QueuedAccounting) -> None:
        """Add what was queued for the same lease after this entry."""
        # A lease has one TPM correction at most (a permit settles once; a compensation is
        # for a lease no permit was made of), so the sum is that correction, and the script
        # applying it does so once even if this entry's part already ran.
        self.delta += later.delta
        self.release = self.release or later.release
        self.compensation = self.compensation or later.compensation


class _Batch:
    """Accounting taken from the queue to be sent: the entries, and their operations."""

    __slots__ = ("entries", "ops", "progress")

    def __init__(
        self, entries: dict[str, _QueuedAccounting], progress: bool, ops: list[_Op]
    ) -> None:
        self.entries = entries
        self.progress = progress
        self.ops = ops


class RedisPermit(OnceOnlyPermit):
    """One admitted attempt. ``settle`` and ``release`` act once; later calls are no-ops.

    Both only queue their write (see the module docstring), so neither waits for Redis or
    raises for backend trouble.
    """

    __slots__ = ("_acquired_arg", "_keys", "_lease_arg", "_lease_id", "_limiter")

    def __init__(
        self,
        limiter: RedisLimiter,
        lease_id: str,
        lease_arg: bytes,
        source: str,
        keys: _SourceWindow,
        est_tokens: int,
        acquired_arg: bytes,
    ) -> None:
        super().__init__(source, est_tokens)
        self._limiter = limiter
        self._lease_id = lease_id
        self._lease_arg = lease_arg
        self._keys = keys
        self._acquired_arg = acquired_arg

    @property
    def lease_id(self) -> str:
        return self._lease_id

    @property
    def window(self) -> int:
        """The acquire-time window id (server minutes since the epoch) that ``settle`` moves."""
        return self._keys.window

    def _apply_settle(self, delta: int) -> None:
        self._limiter._queue(
            self._lease_id, self._lease_arg, self._keys, delta, False, False, self._acquired_arg
        )

    def _apply_release(self) -> None:
        self._limiter._queue(
            self._lease_id, self._lease_arg, self._keys, 0, True, False, self._acquired_arg
        )


class RedisLimiter:
    """``ports.RateLimiter`` shared through Redis by every process using the same scope.

    ``client`` is a ``redis.asyncio.Redis`` or ``RedisCluster`` (``pgw_redis.connection.
    connect``); it is closed by ``aclose()`` only when ``owns_client`` is true. ``clock``
    (default: the system clock) only seeds the estimate of the server's minute; every decision
    uses the server's time.
    """

    __slots__ = (
        "_admissions",
        "_client",
        "_closed",
        "_disconnected",
        "_fixed_args",
        "_flush_tasks",
        "_forming",
        "_global_limits",
        "_ints",
        "_keys",
        "_lease_ttl_arg",
        "_lease_ttl_ms",
        "_lease_ttl_s",
        "_made_keys",
        "_made_keys_window",
        "_monotonic",
        "_now_s",
        "_offset_ms",
        "_owns_client",
        "_pending",
        "_progress_op",
        "_progress_pending",
        "_retry_delay_s",
        "_retry_handle",
        "_retry_since",
        "_scope",
        "_scripts",
        "_source_keys",
        "_warn",
    )

    def __init__(
        self,
        client: RedisClient,
        *,
        scope: str,
        global_limits: Limits,
        lease_ttl_s: float,
        clock: Clock | None = None,
        owns_client: bool = False,
    ) -> None:
        check_limits(global_limits, "global_limits")
        lease_ttl_s = check_ttl(lease_ttl_s, "lease_ttl_s")
        self._client = client
        self._scripts = ScriptClient(client)
        self._scope = scope
        self._keys = LimiterKeys.for_scope(scope)
        self._global_limits = global_limits
        self._lease_ttl_s = lease_ttl_s
        self._lease_ttl_ms = max(1, round(lease_ttl_s * 1000.0))
        self._now_s: Callable[[], float] = clock.time if clock is not None else time.time
        self._monotonic: Callable[[], float] = (
            clock.monotonic if clock is not None else time.monotonic
        )
        self._retry_handle: asyncio.TimerHandle | None = None
        self._retry_since: float | None = None
        self._retry_delay_s = RETRY_FIRST_S
        self._offset_ms = 0.0
        self._owns_client = owns_client
        self._source_keys: dict[str, SourceKeys] = {}
        self._pending: dict[str, _QueuedAccounting] = {}
        self._admissions: list[_Admission] = []
        self._made_keys: dict[str, _SourceWindow] = {}
        self._made_keys_window = -1
        self._fixed_args = (self._lease_ttl_ms, global_limits)
        self._ints = EncodedInts()
        self._lease_ttl_arg = bulk(self._lease_ttl_ms)
        self._progress_op: _Op = (1, bulk(self._keys.progress), 1, _PROGRESS_HEAD)
        self._progress_pending = False
        self._flush_tasks: set[asyncio.Task[None]] = set()
        self._forming: asyncio.Task[None] | None = None
        """The batch task made but not yet started: what is queued meanwhile goes in it."""
        self._closed = False
        """Set when ``aclose()`` starts: admissions are refused, no batch starts by itself."""
        self._disconnected = False
        """Set when ``aclose()`` is done: nothing can send a write any more."""
        self._warn = WarnOnce(logger, f"Redis limiter (scope {scope!r})")

    @property
    def scope(self) -> str:
        return self._scope

    @property
    def global_limits(self) -> Limits:
        """The scope-wide gates' limits (every client sharing this limiter shares them)."""
        return self._global_limits

    def claim_scope(self, scope: str) -> str:
        """The owner scope (this limiter's key space): another scope's sources are keyed
        ``<scope>:<name>`` inside it, so same-named sources of two roles never share a gate."""
        return self._scope

    # ------------------------------------------------------------------ admission

    async def try_acquire(
        self, source: str, est_tokens: int, source_limits: Limits
    ) -> Permit | Denial:
        est_tokens = _checked_inputs(est_tokens, source_limits)
        # Made before sending, so a script that ran for a caller who never saw the reply can
        # still be released by id.
        lease_id = new_lease_id()
        lease_arg = bulk(lease_id)
        window = self._guess_window()
        for _ in range(_WINDOW_ATTEMPTS):
            keys = self._source_window(source, window)
            admission = self._enqueue(keys.acquire_op(lease_arg, est_tokens, source_limits), False)
            try:
                reply = await admission.future
            except (asyncio.CancelledError, GovernanceBackendError):
                self._abandon(admission, lease_id, lease_arg, keys, est_tokens)
                raise
            at = admission.at
            admitted = self._admitted(reply, at, source, lease_id, lease_arg, keys, est_tokens)
            if admitted is not None:
                return admitted
            window = self._learn_server_time(int(reply[at + 1]))
        raise self._window_error()

    def joint_with(self, gate: ProviderGate) -> JointAdmit | None:
        """``enter_and_acquire`` bound to ``gate`` when both can be asked in one script call:
        ``gate`` is a ``RedisGate`` of the same scope on the same plain Redis server (a
        Cluster is left to the separate calls). Otherwise ``None``."""
        from pgw_redis.breaker import RedisGate

        if not isinstance(gate, RedisGate) or gate.scope != self._scope:
            return None
        if not same_server(self._client, gate.client):
            return None
        return partial(self.enter_and_acquire, gate)

    async def enter_and_acquire(
        self, gate: RedisGate, source: str, est_tokens: int, source_limits: Limits
    ) -> tuple[GateDecision, Permit | Denial | None]:
        """``gate.try_enter(source)`` then, if it lets the caller through, ``try_acquire``:
        one script run, so one round trip (shared with other admissions and the queued
        accounting). The permit part is ``None`` when the gate refuses.

        Cancelled or failed after sending: the probe it may have been given is handed back
        and the lease compensated, as each call alone would do.
        """
        est_tokens = _checked_inputs(est_tokens, source_limits)
        lease_id = new_lease_id()
        lease_arg = bulk(lease_id)
        gate_key, enter_args = gate.joint_enter_args(source)
        window = self._guess_window()
        answered = False  # a reply came: the gate may have made this caller the probe
        for _ in range(_WINDOW_ATTEMPTS):
            keys = self._source_window(source, window)
            # The lease id is the probe owner id too: one random id a call.
            op = keys.joint_op(gate_key, enter_args, lease_arg, est_tokens, source_limits)
            admission = None
            try:
                admission = self._enqueue(op, True)
                reply = await admission.future
            except (asyncio.CancelledError, GovernanceBackendError):
                if admission is not None:
                    self._abandon(admission, lease_id, lease_arg, keys, est_tokens)
                # The script may have run and made this caller the probe: hand it back
                # (unless no script of this call ever reached Redis).
                if answered or (admission is not None and admission.sent):
                    gate.hand_back_later(gate_key, lease_id)
                raise
            answered = True
            at = admission.at
            decision = gate.joint_decision(source, reply, at)
            if not decision.allowed:
                return decision, None
            at += _GATE_FIELDS
            try:
                admitted = self._admitted(reply, at, source, lease_id, lease_arg, keys, est_tokens)
            except GovernanceBackendError:
                gate.hand_back_later(gate_key, lease_id)
                raise
            if admitted is not None:
                return decision, admitted
            window = self._learn_server_time(int(reply[at + 1]))
        gate.hand_back_later(gate_key, lease_id)
        raise self._window_error()

    def _source_window(self, source: str, window: int) -> _SourceWindow:
        # The same keys for every admission of a source within a minute: made once.
        if window != self._made_keys_window:
            self._made_keys = {}
            self._made_keys_window = window
        made = self._made_keys.get(source)
        if made is None:
            made = self._made_keys[source] = _SourceWindow(
                self._keys, self._keys_of(source), window, self._fixed_args, self._ints
            )
        return made

    def _enqueue(self, op: _Op, joint: bool) -> _Admission:
        """Queue an admission for the next batch (refused once ``aclose()`` has started);
        ``joint``: a gate_acquire."""
        if self._closed:
            raise GovernanceBackendError(f"Redis limiter (scope {self._scope!r}) is closed")
        admission = _Admission(op, asyncio.get_running_loop().create_future(), joint)
        self._admissions.append(admission)
        self._schedule_flush(admission=True)
        return admission

    def _abandon(
        self,
        admission: _Admission,
        lease_id: str,
        lease_arg: bytes,
        keys: _SourceWindow,
        est_tokens: int,
    ) -> None:
        """The caller of ``admission`` is cancelled, or its batch failed.

        After it was sent, the script may have run: what it may have taken is freed (a queued
        compensation, a no-op when the lease does not exist). Cancelled before it was sent, it
        is simply taken off the queue; a batch that failed before reaching Redis leaves
        nothing to free either.
        """
        if not admission.sent:
            if admission in self._admissions:  # else a batch took it already
                self._admissions.remove(admission)
        else:
            self._queue(lease_id, lease_arg, keys, -est_tokens, True, True, _UNKNOWN_TIME)

    def _admitted(
        self,
        reply: Any,
        at: int,
        source: str,
        lease_id: str,
        lease_arg: bytes,
        keys: _SourceWindow,
        est_tokens: int,
    ) -> Permit | Denial | None:
        """The acquire reply (the three values of ``reply`` from ``at``) as a permit or a
        denial; ``None``: retry with the server's window."""
        status = int(reply[at])
        if status == 1:
            server_ms = int(reply[at + 1])
            self._learn_server_time(server_ms)
            return RedisPermit(
                self, lease_id, lease_arg, source, keys, est_tokens, self._ints[server_ms]
            )
        if status == 0:
            return Denial(_GATES[int(reply[at + 1]) - 1], max(0.0, int(reply[at + 2]) / 1000.0))
        if status == -2:  # only a compensation writes this; its caller is gone
            raise GovernanceBackendError(f"lease {lease_id} was given up before admission")
        return None

    def _window_error(self) -> GovernanceBackendError:
        return GovernanceBackendError(
            f"Redis limiter (scope {self._scope!r}): the server's minute kept changing "
            f"during {_WINDOW_ATTEMPTS} admission attempts"
        )

    # ------------------------------------------------------------------ introspection

    async def source_stats(self, source: str) -> SourceStats:
        source_keys = self._keys_of(source)
        window = self._guess_window()
        for _ in range(_WINDOW_ATTEMPTS):
            w = str(window)
            call = ScriptCall(
                SOURCE_STATS,
                (source_keys.lease, source_keys.rpm_base + w, source_keys.tpm_base + w),
                (window,),
            )
            reply = await self._exchange(call, "source_stats")
            if int(reply[0]) == 1:
                return SourceStats(
                    inflight=int(reply[1]), rpm_used=int(reply[2]), tpm_used=int(reply[3])
                )
            window = self._learn_server_time(int(reply[1]))
        raise GovernanceBackendError(
            f"Redis limiter (scope {self._scope!r}): the server's minute kept changing"
        )

    async def inflight(self) -> int:
        reply = await self._exchange(ScriptCall(INFLIGHT, (self._keys.lease,), ()), "inflight")
        return int(reply)

    async def mark_progress(self) -> None:
        self._progress_pending = True
        self._schedule_flush()

    async def progress_age_s(self) -> float:
        call = ScriptCall(PROGRESS_AGE, (self._keys.progress,), ())
        age_ms = int(await self._exchange(call, "progress_age_s"))
        return math.inf if age_ms < 0 else age_ms / 1000.0

    # ------------------------------------------------------------------ lifecycle

    async def flush(self) -> None:
        """Wait until every accounting write queued so far has been sent and answered, and
        every batch on the wire now has landed.

        A write Redis did not take is kept and sent again in the background (see the module
        docstring); ``flush()`` does not wait for those retries.
        """
        in_flight = tuple(self._flush_tasks)
        # Taken now, so that no batch started later carries them past the waits below.
        await self._send_in_turn(self._take_all_queued())
        if in_flight:
            # asyncio.wait: a caller cancelled here must not cancel the batches themselves.
            await asyncio.wait(in_flight)

    async def aclose(self) -> None:
        """Refuse new admissions, wait for the batches on the wire, send the queued
        accounting (one try), then close the client if this limiter owns it."""
        if self._closed:
            return
        self._closed = True
        if self._retry_handle is not None:
            self._retry_handle.cancel()
            self._retry_handle = None
        # Queued, never sent: nothing to undo.
        queued, self._admissions = self._admissions, []
        _fail(queued, "the Redis limiter was closed", None)
        try:
            while self._flush_tasks:  # none starts once closed: this ends
                await asyncio.wait(tuple(self._flush_tasks))
            # What they queued (compensations of failed or cancelled calls) goes too.
            await self._send_in_turn(self._take_all_queued())
        finally:
            self._disconnected = True
            if self._pending:
                self._warn.failed(
                    "accounting at close",
                    GovernanceBackendError("Redis did not answer"),
                    f"{len(self._pending)} release/settle write(s) dropped; leases expire "
                    "after their TTL",
                )
                self._pending = {}
            self._progress_pending = False
            await self._scripts.disconnect()
            if self._owns_client:
                await self._client.aclose()

    # ------------------------------------------------------------------ internals

    def _keys_of(self, source: str) -> SourceKeys:
        keys = self._source_keys.get(source)
        if keys is None:
            keys = self._source_keys[source] = self._keys.source(source)
        return keys

    def _guess_window(self) -> int:
        return int((self._now_s() * 1000.0 + self._offset_ms) // WINDOW_MS)

    def _learn_server_time(self, server_ms: int) -> int:
        """Remember the server clock's offset; return the server's current window id."""
        self._offset_ms = server_ms - self._now_s() * 1000.0
        return server_ms // WINDOW_MS

    async def _exchange(self, call: ScriptCall, operation: str) -> Any:
        """Run the read ``call`` behind the queued accounting.

        It sees every write this limiter queued before it: those on the wire (it waits for
        the batches in flight) and those still queued (sent in front of it, in the same round
        trip unless the backlog needs more than one call). Backend failures raise
        ``GovernanceBackendError``. The accounting taken along is not this caller's: if the
        exchange does not complete, what was not delivered is queued again.
        """
        in_flight = tuple(self._flush_tasks)
        batches = self._take_all_queued()
        last = batches.pop() if batches else None
        sent = 0
        delivered = False
        try:
            if in_flight:
                await asyncio.wait(in_flight)
            for batch in batches:
                (result,) = await self._run((_batch_call(batch.ops, self._ints),))
                sent += 1
                self._delivered()
                self._check_accounting(result)
            calls: tuple[AnyCall, ...] = (
                (call,) if last is None else (_batch_call(last.ops, self._ints), call)
            )
            results = await self._run(calls)
            delivered = True
        except BACKEND_ERRORS as exc:
            raise self._backend_error(operation, exc) from exc
        finally:
            if not delivered:
                for batch in batches[sent:]:
                    self._requeue(batch)
                if last is not None:
                    self._requeue(last)
                if batches or last is not None:
                    self._schedule_flush()
        if last is not None:
            self._delivered()
            self._check_accounting(results[0])
        result = results[-1]
        if isinstance(result, Exception):
            raise self._backend_error(operation, result) from result
        self._warn.succeeded()
        return result

    def _backend_error(self, operation: str, exc: BaseException) -> GovernanceBackendError:
        return GovernanceBackendError(self._backend_message(operation, exc))

    def _backend_message(self, operation: str, exc: BaseException) -> str:
        return (
            f"Redis limiter (scope {self._scope!r}): {operation} failed: "
            f"{type(exc).__name__}: {exc}"
        )

    async def _run(self, calls: Sequence[AnyCall]) -> list[Any]:
        try:
            return await self._scripts.run_many(calls)
        except RedisConnectionError as first:
            # A pooled connection that died with the server (restart, failover, idle kill)
            # fails once although Redis is back: one more try, on a fresh connection. Safe,
            # as every script here is idempotent (an acquire is keyed by its lease id).
            try:
                return await self._scripts.run_many(calls)
            except NotSentError:
                if isinstance(first, NotSentError):
                    raise
                raise first from None  # the first try may have run: not "never sent"

    def _queue(
        self,
        lease_id: str,
        lease_arg: bytes,
        keys: _SourceWindow,
        delta: int,
        release: bool,
        compensate: bool,
        acquired_arg: bytes,
    ) -> None:
        """Queue a TPM correction of ``delta`` tokens and, if ``release``, the lease's
        release (``compensate``: of a lease no permit was made of; ``acquired_arg``: see
        ``_QueuedAccounting``)."""
        if self._disconnected:
            self._warn.failed(
                "accounting after close",
                GovernanceBackendError("the limiter is closed"),
                "release/settle dropped; leases expire after their TTL",
            )
            return
        entry = self._pending.get(lease_id)
        if entry is None:
            entry = self._pending[lease_id] = _QueuedAccounting(
                lease_id, lease_arg, keys, acquired_arg
            )
        entry.delta += delta
        if release:
            entry.release = True
        if compensate:
            entry.release = entry.compensation = True
        self._schedule_flush()

    def _schedule_flush(self, *, admission: bool = False) -> None:
        # The batch task is made now and runs at the next turn of the loop: the caller usually
        # has more to queue, and every admission and write queued in the same turn goes in
        # one script call. Admissions may start a batch while up to MAX_BATCHES_IN_FLIGHT - 1
        # others are on the wire (an admission never waits for another's round trip); writes
        # alone wait for the batches in flight, and then go together. During an outage the
        # retry timer starts the next flush of accounting (no busy loop); an admission is sent
        # at once all the same (it must fail or pass promptly).
        if self._forming is not None or self._closed:
            return
        in_flight = len(self._flush_tasks)
        if admission:
            if in_flight >= MAX_BATCHES_IN_FLIGHT:
                return  # sent as soon as a batch in flight lands
        elif in_flight or self._retry_handle is not None:
            return
        self._start_flush()

    def _retry_due(self) -> None:
        self._retry_handle = None
        if self._forming is None and not self._flush_tasks and not self._closed:
            self._start_flush()

    def _start_flush(self) -> None:
        # A context of its own: the batch serves many callers, not the one that queued first
        # (whose context, trace and request-scoped logging would otherwise take it over).
        task = asyncio.get_running_loop().create_task(
            self._flush_queued(),
            name=f"pgw-redis limiter flush ({self._scope})",
            context=contextvars.Context(),
        )
        self._forming = task
        self._flush_tasks.add(task)
        task.add_done_callback(self._flush_done)

    def _flush_done(self, task: asyncio.Task[None]) -> None:
        self._flush_tasks.discard(task)
        if self._forming is task:  # cancelled before its first step: it took nothing
            self._forming = None

    async def _flush_queued(self) -> None:
        # Runs at the turn after the one that made it: everything queued until then goes in
        # one script call; what is queued while it is on the wire forms the next batch.
        self._forming = None
        if self._closed:
            return
        admissions = self._take_admissions()
        if self._admissions:
            self._schedule_flush(admission=True)  # the rest in the next batch, if one may go
        batch = self._take_queued()
        try:
            if admissions:
                await self._send_admissions(batch, admissions)
            elif batch is not None:
                await self._send_accounting(batch)
        finally:
            # This batch has landed: count it out before starting the next (the done
            # callback would do so only after this returns).
            task = asyncio.current_task()
            if task is not None:
                self._flush_tasks.discard(task)
        if self._admissions:
            self._schedule_flush(admission=True)
        elif self._pending or self._progress_pending:
            self._schedule_flush()

    def _take_admissions(self) -> list[_Admission]:
        admissions = self._admissions
        limit = min(
            MAX_BATCH_ADMISSIONS, max(SMALL_BATCH_ADMISSIONS, len(admissions) // BURST_SHARE)
        )
        if len(admissions) > limit:
            taken = admissions[:limit]
            self._admissions = admissions[limit:]
        else:
            taken = admissions
            self._admissions = []
        # An admission whose caller was cancelled since it queued (its future is cancelled at
        # once, before the caller runs again) is left out: it was never sent.
        sent = []
        for admission in taken:
            if not admission.future.done():
                admission.sent = True
                sent.append(admission)
        return sent

    async def _send_admissions(self, batch: _Batch | None, admissions: list[_Admission]) -> None:
        """Queued accounting and ``admissions`` in one script call; each admission's reply
        (or the failure, as a ``GovernanceBackendError`` of its own) goes to its caller.

        Whatever goes wrong, no caller is left waiting: an unexpected error (a reply of the
        wrong shape, say) fails the admissions as a backend error does.
        """
        accounting = batch.ops if batch is not None else []
        try:
            call = _batch_call([*accounting, *map(_op_of, admissions)], self._ints)
            (result,) = await self._run((call,))
        except asyncio.CancelledError:
            # The loop is shutting down: the callers learn their admission failed (and
            # compensate); the accounting stays for this limiter's next command or flush.
            _fail(admissions, "the admission was cancelled", None)
            if batch is not None:
                self._requeue(batch)
            raise
        except BaseException as exc:
            if isinstance(exc, NotSentError):
                for admission in admissions:
                    admission.sent = False  # nothing ran: no compensation to queue
            _fail(admissions, self._backend_message("try_acquire", exc), exc)
            if batch is not None:
                self._retry_later(batch, exc)
            if not isinstance(exc, Exception):
                raise
            return
        if batch is not None:
            self._delivered()
        try:
            if isinstance(result, Exception):
                if batch is not None:
                    self._check_accounting(result)
                raise result
            # One flat reply: a value per accounting operation, then each admission's fields.
            # Every admission gets the whole reply and where its fields start.
            at = len(accounting)
            for admission in admissions:
                admission.at = at
                at += _JOINT_FIELDS if admission.joint else _ACQUIRE_FIELDS
            if len(result) != at:
                raise ValueError(f"the batch answered {len(result)} values of {at}")
            self._warn.succeeded()
            for admission in admissions:
                if not admission.future.done():
                    admission.future.set_result(result)
        except Exception as exc:  # noqa: BLE001 - it reaches every caller, as their error
            _fail(admissions, self._backend_message("try_acquire", exc), exc)

    def _take_queued(self) -> _Batch | None:
        """Take the oldest queued accounting, ``MAX_BATCH_ACCOUNTING`` operations at most."""
        pending = self._pending
        progress = self._progress_pending
        if not pending and not progress:
            return None
        if len(pending) <= MAX_BATCH_ACCOUNTING:
            taken = pending
            self._pending = {}
        else:
            # Each entry makes one operation at most; the rest stays queued, in order.
            taken = {
                lease_id: pending.pop(lease_id)
                for lease_id in list(islice(pending, MAX_BATCH_ACCOUNTING))
            }
        ops: list[_Op] = []
        mark = progress
        for entry in taken.values():
            keys = entry.keys
            if entry.release:
                args = (
                    _RELEASE_HEAD,
                    entry.lease_arg,
                    self._ints[entry.delta],
                    _TRUE if entry.compensation else _FALSE,
                    _TRUE if mark else _FALSE,
                    self._lease_ttl_arg,
                    keys.window_end_arg,
                    entry.acquired_arg,
                )
                ops.append((_RELEASE_KEYS, keys.release_keys, _RELEASE_ARGS, b"".join(args)))
                mark = False  # one mark per batch is enough
            elif entry.delta:
                settle = (
                    _SETTLE_HEAD,
                    self._ints[entry.delta],
                    entry.lease_arg,
                    keys.window_end_arg,
                )
                ops.append((_SETTLE_KEYS, keys.settle_keys, _SETTLE_ARGS, b"".join(settle)))
        if mark:
            if len(ops) < MAX_BATCH_ACCOUNTING:
                ops.append(self._progress_op)
            else:
                progress = False  # no room: the next batch carries it
        self._progress_pending = self._progress_pending and not progress
        return _Batch(taken, progress, ops)

    def _take_all_queued(self) -> list[_Batch]:
        """Everything queued, as batches of ``MAX_BATCH_ACCOUNTING`` operations at most."""
        batches: list[_Batch] = []
        while (batch := self._take_queued()) is not None:
            batches.append(batch)
        return batches

    def _requeue(self, batch: _Batch) -> None:
        """Queue ``batch`` again, merged with what was queued for its leases since (its
        scripts are idempotent, and one lease's writes add up in any order)."""
        # In place: a chunk of a long backlog goes back without copying the rest.
        pending = self._pending
        for lease_id, entry in batch.entries.items():
            later = pending.get(lease_id)
            if later is not None:
                entry.absorb(later)
            pending[lease_id] = entry
        self._progress_pending = self._progress_pending or batch.progress

    async def _send_accounting(self, batch: _Batch) -> bool:
        """Send ``batch`` alone; whether Redis took it (if not, it is kept for a retry)."""
        if not batch.ops:
            return True
        try:
            (result,) = await self._run((_batch_call(batch.ops, self._ints),))
        except asyncio.CancelledError:
            # Whoever sent it is going away (a cancelled flush(), the loop shutting down):
            # keep it for this limiter's next command or flush rather than lose it.
            self._requeue(batch)
            raise
        except BaseException as exc:
            self._retry_later(batch, exc)
            if not isinstance(exc, Exception):
                raise
            return False
        self._delivered()
        self._check_accounting(result)
        return True

    async def _send_in_turn(self, batches: list[_Batch]) -> None:
        """Send ``batches`` one call after the other, stopping at the first that fails (it and
        the rest are kept for a retry)."""
        for index, batch in enumerate(batches):
            delivered = False
            try:
                delivered = await self._send_accounting(batch)
            finally:
                if not delivered:
                    for rest in batches[index + 1 :]:
                        self._requeue(rest)
            if not delivered:
                return

    def _retry_later(self, batch: _Batch, exc: BaseException) -> None:
        """Keep a batch that Redis did not take and send it again after a backoff; once the
        outage outlasted the retry bound, drop it and everything queued (warned). A closing
        limiter keeps it for ``aclose()``'s last try."""
        if self._closed:
            self._requeue(batch)
            return
        now = self._monotonic()
        if self._retry_since is None:
            self._retry_since = now
        bound_s = max(RETRY_FOR_S, 2.0 * self._lease_ttl_s)
        if now - self._retry_since > bound_s:
            dropped = len(batch.entries) + len(self._pending)
            self._pending = {}
            self._progress_pending = False
            self._warn.failed(
                "accounting",
                exc,
                f"{dropped} release/settle write(s) dropped; leases expire after their TTL",
            )
            self._retry_since = None
            self._retry_delay_s = RETRY_FIRST_S
            return
        self._warn.failed("accounting", exc, "kept and sent again until Redis takes it")
        self._requeue(batch)
        if self._retry_handle is None:
            delay = self._retry_delay_s
            self._retry_delay_s = min(RETRY_MAX_S, delay * 2.0)
            self._retry_handle = asyncio.get_running_loop().call_later(delay, self._retry_due)

    def _delivered(self) -> None:
        """Redis took queued accounting: the next outage starts its backoff afresh."""
        self._retry_since = None
        self._retry_delay_s = RETRY_FIRST_S

    def _check_accounting(self, result: Any) -> None:
        """``result``: the reply of a batch of accounting (a list), or the error it raised."""
        if isinstance(result, Exception):
            self._warn.failed("accounting", result, "release/settle/progress dropped")
            return
        self._warn.succeeded()

    def __repr__(self) -> str:
        return (
            f"RedisLimiter(scope={self._scope!r}, global_limits={self._global_limits!r}, "
            f"lease_ttl_s={self._lease_ttl_s!r})"
        )


def _checked_inputs(est_tokens: int, source_limits: Limits) -> int:
    """``est_tokens``, checked with ``source_limits`` (``ValueError`` for bad ones)."""
    if type(est_tokens) is not int or not 0 <= est_tokens <= MAX_TOKENS:
        est_tokens = check_token_count(est_tokens, "est_tokens")
    if (source_limits.max_concurrency | source_limits.rpm | source_limits.tpm) < 0:
        check_limits(source_limits, "source_limits")
    return est_tokens


def _fail(admissions: Sequence[_Admission], message: str, cause: BaseException | None) -> None:
    """Fail every admission still waiting, each with an exception of its own: the callers are
    unrelated requests, and a raised exception takes on its handler's traceback and notes."""
    for admission in admissions:
        if not admission.future.done():
            error = GovernanceBackendError(message)
            error.__cause__ = cause
            admission.future.set_exception(error)


def same_server(a: RedisClient, b: RedisClient) -> bool:
    """Whether two plain-Redis clients talk to the same server and database as the same user.

    Clusters answer ``False``: their scripts are routed per command by the client.
    """
    if isinstance(a, RedisCluster) or isinstance(b, RedisCluster):
        return False
    ka, kb = a.connection_pool.connection_kwargs, b.connection_pool.connection_kwargs
    fields = ("host", "port", "path", "db", "username", "password")
    return a.connection_pool.connection_class is b.connection_pool.connection_class and all(
        ka.get(f) == kb.get(f) for f in fields
    )
