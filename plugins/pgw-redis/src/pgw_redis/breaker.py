"""The shared circuit breaker: one HASH per source, one Lua script per operation (M2 §3).

Same algorithm as the in-memory gate, field for field (``state``, ``epoch``, ``failures``,
``open_until``, ``probe_until``, ``probe_owner``), with the Redis server's clock:

- closed: every caller passes; failures count; ``threshold`` failures -> open.
- open: refused until ``open_until``; the first caller after it becomes the probe.
- half_open: one probe, leased until ``probe_until``; a lapsed or handed-back lease goes to
  the next caller (lazy reissue, no watchdog).
- The epoch increments only when entering open. A write-back quoting another epoch (or, for a
  probe, another owner) is fenced: ``applied=False`` with the current state, nothing written.
- Probe ids are made here before the script is sent: a ``try_enter`` cancelled after sending
  hands back the probe it may have been given (or, if its script has not run yet, marks the
  id abandoned so that it never becomes the probe), so nobody waits for the probe TTL.

The hash carries a TTL refreshed on every write (``max(1 h, 2 x (cooldown + probe TTL))``):
no key is left without one, and it outlives any open period or probe lease.

Round trips: one per operation, except ``record_success`` on a closed breaker that this
instance last saw closed, in the same epoch, with no failures (the common success). That
write-back would write nothing, so it is answered from that view without a round trip
(``elide_clean_success``, default on). Fencing is unaffected: nothing is ever written from a
stale decision. The one difference is the answer when another process opened the breaker
since this instance last heard from Redis: ``applied=True`` instead of ``False``. Turn the
option off to ask Redis every time.

Scopes: the gate's keys carry its scope (``pgw:gate:{<scope>}:<source>``, ``pgw_redis.keys``).
Handed to another scope's client as well, ``for_scope`` gives that scope a gate on the same
connections with that scope's keys, the ones its own gate in any other process uses: state is
per scope and source, so same-named sources of two roles never open each other.

Degradation: ``try_enter``, ``state`` and ``retry_after_s`` (admission) and the write-backs
that return an answer (``record_success``, ``record_failure``, ``force_open``) raise
``GovernanceBackendError`` when Redis fails; the retry layer turns the write-back ones into
warnings. ``release_probe`` only warns.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Coroutine, Sequence
from typing import Any, Final, cast

from polygateway.errors import GovernanceBackendError
from polygateway.ports import GateDecision, GateState, GateUpdate
from polygateway.validation import check_max_cooldown, check_threshold, check_ttl
from redis.exceptions import ConnectionError as RedisConnectionError

from pgw_redis._warn import WarnOnce
from pgw_redis.connection import (
    BACKEND_ERRORS,
    RedisClient,
    ScriptCall,
    ScriptClient,
    as_text,
    bulk,
)
from pgw_redis.keys import gate_key, new_id, scope_tag
from pgw_redis.scripts import (
    GATE_FORCE_OPEN,
    GATE_RECORD_FAILURE,
    GATE_RECORD_SUCCESS,
    GATE_RELEASE_PROBE,
    GATE_RETRY_AFTER,
    GATE_TRY_ENTER,
)

logger = logging.getLogger(__name__)

_STATES: Final = frozenset(("closed", "open", "half_open"))
_MIN_KEY_TTL_S: Final = 3600.0


class RedisGate:
    """``ports.ProviderGate`` shared through Redis by every process using the same scope.

    ``client`` is a ``redis.asyncio.Redis`` or ``RedisCluster``; ``aclose()`` closes it only
    when ``owns_client`` is true.
    """

    __slots__ = (
        "_background",
        "_clean_updates",
        "_client",
        "_closed_decisions",
        "_cooldown_ms",
        "_cooldown_s",
        "_elide",
        "_enter_tail",
        "_fail_threshold",
        "_key_ttl_ms",
        "_keys",
        "_max_cooldown_ms",
        "_max_cooldown_s",
        "_owns_client",
        "_probe_ttl_ms",
        "_probe_ttl_s",
        "_root",
        "_scope",
        "_scopes",
        "_scripts",
        "_tag",
        "_views",
        "_warn",
    )

    def __init__(
        self,
        client: RedisClient,
        *,
        scope: str,
        fail_threshold: int,
        cooldown_s: float,
        probe_ttl_s: float,
        elide_clean_success: bool = True,
        owns_client: bool = False,
        max_cooldown_s: float | None = None,
    ) -> None:
        check_threshold(fail_threshold, "fail_threshold")
        if not (cooldown_s >= 0.0 and math.isfinite(cooldown_s)):
            raise ValueError(f"cooldown_s must be a finite number >= 0, got {cooldown_s!r}")
        probe_ttl_s = check_ttl(probe_ttl_s, "probe_ttl_s")
        self._client = client
        self._scripts = ScriptClient(client)
        self._scope = scope
        self._tag = scope_tag(scope)
        self._fail_threshold = fail_threshold
        self._cooldown_s = float(cooldown_s)
        self._probe_ttl_s = probe_ttl_s
        self._cooldown_ms = round(cooldown_s * 1000.0)
        self._max_cooldown_s = check_max_cooldown(cooldown_s, max_cooldown_s)
        self._max_cooldown_ms = round(self._max_cooldown_s * 1000.0)
        self._probe_ttl_ms = max(1, round(probe_ttl_s * 1000.0))
        self._key_ttl_ms = round(
            max(_MIN_KEY_TTL_S, 2.0 * (self._max_cooldown_s + probe_ttl_s)) * 1000.0
        )
        # try_enter's arguments after the owner id, encoded for the limiter's joint admission.
        self._enter_tail = bulk(self._probe_ttl_ms) + bulk(self._key_ttl_ms)
        self._elide = elide_clean_success
        self._owns_client = owns_client
        self._keys: dict[str, str] = {}
        # source -> (epoch, state, failures) as last answered by Redis to this instance.
        self._views: dict[str, tuple[int, str, int]] = {}
        # Decisions are immutable: one closed-state decision per source and epoch is shared.
        self._closed_decisions: dict[str, GateDecision] = {}
        # The same for the answer to an elided clean success.
        self._clean_updates: dict[str, GateUpdate] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._warn = WarnOnce(logger, f"Redis breaker (scope {scope!r})")
        # scope -> its gate, shared by this gate and every gate ``for_scope`` made from it;
        # ``_root`` is the gate they were made from (``None``: this one), which owns the
        # connections.
        self._scopes: dict[str, RedisGate] = {scope: self}
        self._root: RedisGate | None = None

    @property
    def scope(self) -> str:
        return self._scope

    def for_scope(self, scope: str) -> RedisGate:
        """The gate of ``scope``'s sources: this one for its own scope, else one on the same
        connections keyed under ``scope`` (the same each time; ``aclose`` of the gate they were
        made from closes them all)."""
        gate = self._scopes.get(scope)
        if gate is None:
            root = self if self._root is None else self._root
            gate = RedisGate(
                self._client,
                scope=scope,
                fail_threshold=self._fail_threshold,
                cooldown_s=self._cooldown_s,
                probe_ttl_s=self._probe_ttl_s,
                elide_clean_success=self._elide,
                max_cooldown_s=self._max_cooldown_s,
            )
            gate._scripts = self._scripts  # one set of connections and loaded scripts
            gate._scopes = self._scopes
            gate._root = root
            self._scopes[scope] = gate
        return gate

    # ------------------------------------------------------------------ admission

    async def try_enter(self, source: str) -> GateDecision:
        key = self._key(source)
        owner = new_id()
        call = ScriptCall(GATE_TRY_ENTER, (key,), (owner, self._probe_ttl_ms, self._key_ttl_ms))
        try:
            reply = await self._run(call, "try_enter", idempotent=True)
        except (asyncio.CancelledError, GovernanceBackendError):
            # The script may have run and made this caller the probe: hand it back.
            self._in_background(self._hand_back(key, owner))
            raise
        return self.joint_decision(source, reply)

    # The limiter's joint admission (``RedisLimiter.enter_and_acquire``) runs this gate's
    # try_enter inside its own script call: these three are its side of it.

    @property
    def client(self) -> RedisClient:
        return self._client

    def joint_enter_args(self, source: str) -> tuple[str, bytes]:
        """The gate key of ``source`` and try_enter's arguments after the probe owner id,
        encoded (``connection.bulk``). The limiter sends its lease id as the owner id: it is
        as unique, and the call needs no second random id."""
        return self._key(source), self._enter_tail

    def hand_back_later(self, key: str, owner: str) -> None:
        """Hand back, in the background, the probe a try_enter for ``owner`` may have got."""
        self._in_background(self._hand_back(key, owner))

    def joint_decision(self, source: str, reply: Any, at: int = 0) -> GateDecision:
        """The decision of a try_enter reply, the six values of ``reply`` from ``at`` (this
        instance's view of the source updated)."""
        state = reply[at + 1]
        if type(state) is not str:
            state = as_text(state)
        epoch = int(reply[at + 2])
        self._views[source] = (epoch, state, int(reply[at + 3]))
        if state == "closed":
            decision = self._closed_decisions.get(source)
            if decision is None or decision.epoch != epoch:
                decision = self._closed_decisions[source] = GateDecision(
                    source, True, "closed", epoch
                )
            return decision
        if int(reply[at]):
            return GateDecision(
                source, True, _state(state), epoch, probe_owner=as_text(reply[at + 4])
            )
        return GateDecision(
            source,
            False,
            _state(state),
            epoch,
            retry_after_s=max(0.0, int(reply[at + 5]) / 1000.0),
        )

    async def retry_after_s(self, sources: Sequence[str]) -> float:
        if isinstance(sources, str):
            raise ValueError("retry_after_s needs a sequence of source names, not one string")
        if not sources:
            raise ValueError("retry_after_s needs at least one source name")
        keys = tuple(self._key(source) for source in sources)
        call = ScriptCall(GATE_RETRY_AFTER, keys, ())
        wait_ms = await self._run(call, "retry_after_s", idempotent=True)
        return max(0.0, int(wait_ms) / 1000.0)

    async def state(self, source: str) -> GateState:
        """The stored state; open -> half_open happens on the next ``try_enter``."""
        key = self._key(source)
        try:
            fields = await self._client.hmget(key, ["state", "epoch", "failures"])
        except BACKEND_ERRORS as exc:
            raise self._backend_error("state", exc) from exc
        state = _state(as_text(fields[0] or "closed"))
        self._views[source] = (int(fields[1] or 0), state, int(fields[2] or 0))
        return state

    # ------------------------------------------------------------------ write-backs

    async def record_success(self, decision: GateDecision) -> GateUpdate:
        if not decision.allowed:
            _check_allowed(decision, "record_success")
        source = decision.source
        epoch = decision.epoch
        if (
            self._elide
            and decision.probe_owner is None
            and self._views.get(source) == (epoch, "closed", 0)
        ):
            update = self._clean_updates.get(source)
            if update is None or update.epoch != epoch:
                update = self._clean_updates[source] = GateUpdate(source, True, "closed", epoch, 0)
            return update
        call = ScriptCall(
            GATE_RECORD_SUCCESS,
            (self._key(source),),
            (decision.epoch, decision.probe_owner or "", self._key_ttl_ms),
        )
        return self._update(source, await self._run(call, "record_success"))

    async def record_failure(
        self, decision: GateDecision, *, threshold: int | None = None, force_open: bool = False
    ) -> GateUpdate:
        if threshold is None:
            threshold = self._fail_threshold
        else:
            check_threshold(threshold, "threshold")
        _check_allowed(decision, "record_failure")
        call = ScriptCall(
            GATE_RECORD_FAILURE,
            (self._key(decision.source),),
            (
                decision.epoch,
                decision.probe_owner or "",
                threshold,
                1 if force_open else 0,
                self._cooldown_ms,
                self._key_ttl_ms,
                self._max_cooldown_ms,
            ),
        )
        return self._update(decision.source, await self._run(call, "record_failure"))

    async def release_probe(self, decision: GateDecision) -> None:
        """Hand the probe back (no verdict): the next ``try_enter`` becomes the probe at once.

        A no-op for non-probe decisions and probes no longer held. Never raises for backend
        trouble (a warning; the probe lease then runs out by itself).
        """
        if decision.probe_owner is None:
            return
        call = ScriptCall(
            GATE_RELEASE_PROBE,
            (self._key(decision.source),),
            (decision.epoch, decision.probe_owner, self._key_ttl_ms),
        )
        try:
            await self._run(call, "release_probe", idempotent=True)
        except GovernanceBackendError as exc:
            self._warn.failed("release_probe", exc, "the probe lease expires by itself")

    async def force_open(self, source: str) -> GateUpdate:
        """Open now, whatever the state. Already open: the cooldown restarts, same epoch."""
        call = ScriptCall(
            GATE_FORCE_OPEN,
            (self._key(source),),
            (self._fail_threshold, self._cooldown_ms, self._key_ttl_ms, self._max_cooldown_ms),
        )
        return self._update(source, await self._run(call, "force_open"))

    async def aclose(self) -> None:
        """Wait for probe hand-backs still in flight; close the client if owned.

        A gate made by ``for_scope`` only waits for its own hand-backs: the connections are
        its root's, which waits for every scope's before closing them."""
        if self._root is not None:
            if self._background:
                await asyncio.wait(tuple(self._background))
            return
        pending = [task for gate in self._scopes.values() for task in gate._background]
        if pending:
            await asyncio.wait(pending)
        await self._scripts.disconnect()
        if self._owns_client:
            await self._client.aclose()

    # ------------------------------------------------------------------ internals

    def _key(self, source: str) -> str:
        key = self._keys.get(source)
        if key is None:
            key = self._keys[source] = gate_key(self._tag, source)
        return key

    async def _run(self, call: ScriptCall, operation: str, *, idempotent: bool = False) -> Any:
        try:
            try:
                reply = await self._scripts.run(call)
            except RedisConnectionError:
                # A pooled connection that died with the server fails once although Redis is
                # back; only operations that may run twice (try_enter is keyed by its probe
                # id, reads change nothing) get one more try on a fresh connection.
                if not idempotent:
                    raise
                reply = await self._scripts.run(call)
        except BACKEND_ERRORS as exc:
            raise self._backend_error(operation, exc) from exc
        self._warn.succeeded()
        return reply

    def _backend_error(self, operation: str, exc: BaseException) -> GovernanceBackendError:
        return GovernanceBackendError(
            f"Redis breaker (scope {self._scope!r}): {operation} failed: "
            f"{type(exc).__name__}: {exc}"
        )

    def _update(self, source: str, reply: Any) -> GateUpdate:
        applied, state, epoch, failures = reply
        update = GateUpdate(
            source, bool(int(applied)), _state(as_text(state)), int(epoch), int(failures)
        )
        self._views[source] = (update.epoch, update.state, update.failures)
        return update

    async def _hand_back(self, key: str, owner: str) -> None:
        call = ScriptCall(GATE_RELEASE_PROBE, (key,), ("", owner, self._key_ttl_ms))
        try:
            await self._scripts.run(call)
        except BACKEND_ERRORS as exc:
            self._warn.failed("release_probe", exc, "the probe lease expires by itself")

    def _in_background(self, coro: Coroutine[Any, Any, None]) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def __repr__(self) -> str:
        return (
            f"RedisGate(scope={self._scope!r}, fail_threshold={self._fail_threshold}, "
            f"cooldown_s={self._cooldown_s}, probe_ttl_s={self._probe_ttl_s})"
        )


def _state(value: str) -> GateState:
    if value not in _STATES:
        raise GovernanceBackendError(f"Redis breaker: unknown state {value!r} in Redis")
    return cast(GateState, value)


def _check_allowed(decision: GateDecision, method: str) -> None:
    if not decision.allowed:
        raise ValueError(
            f"{method} got a refused decision for source {decision.source!r}: "
            "only admitted attempts report an outcome"
        )
