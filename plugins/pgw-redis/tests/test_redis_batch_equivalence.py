"""The BATCH script against its definition: the same operations as scripts of their own.

BATCH reads the clock, the counters and the gate hashes once and applies some writes once per
key at its end (``scripts._BATCHED``). Whatever it saves, each operation must decide what it
would have decided as a script of its own, run in the same order, and leave the same keys
behind. Each scenario runs twice on a real Redis, under two scopes: once as one BATCH call,
once operation by operation (``ACQUIRE``, ``RELEASE``, ``SETTLE``, ``PROGRESS_MARK``,
``GATE_TRY_ENTER``). Replies and the keys left (type, value, members, expiry) must match;
values that are times may differ by the milliseconds between the two runs.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
from pgw_redis.keys import LimiterKeys, gate_key, new_id, new_lease_id
from pgw_redis.scripts import (
    ACQUIRE,
    BATCH,
    BATCH_REPLY_FIELDS,
    GATE_TRY_ENTER,
    PROGRESS_MARK,
    RELEASE,
    SETTLE,
    LuaScript,
)
from redis.asyncio import Redis

pytestmark = pytest.mark.redis

LEASE_TTL_MS = 30_000
PROBE_TTL_MS = 20_000
GATE_KEY_TTL_MS = 600_000
TIME_TOLERANCE_MS = 2_000
"""Two runs of a scenario are milliseconds apart; a time that differs more is a bug."""
SOURCES = ("s1", "s2")
KINDS = ("acquire", "gate_acquire", "release", "release", "settle", "mark", "gate")
LIMITS = {
    # global concurrency, source concurrency, global rpm, source rpm, global tpm, source tpm
    "s1": (6, 3, 11, 0, 9_000, 4_000),
    "s2": (6, 0, 11, 4, 9_000, 0),
}


@dataclass(frozen=True)
class Op:
    """One operation: its BATCH code, its keys and arguments (as a script of its own takes
    them), and for a gate admission the acquire's keys and arguments too."""

    code: int
    keys: tuple[str, ...]
    args: tuple[str, ...]
    acquire_keys: tuple[str, ...] = ()
    acquire_args: tuple[str, ...] = ()


class Scenario:
    """Operations on one scope, built from names that do not depend on the scope."""

    def __init__(self, scope: str, window: int, now_ms: int = 0) -> None:
        self.scope = scope
        self.window = window
        self.now_ms = now_ms or window * 60_000
        self.keys = LimiterKeys.for_scope(scope)

    def gate(self, source: str) -> str:
        return gate_key(self.keys.tag, source)

    def acquire_keys(self, source: str) -> tuple[str, ...]:
        k, s, w = self.keys, self.keys.source(source), str(self.window)
        return (
            k.lease, s.lease, k.rpm_base + w, s.rpm_base + w, k.tpm_base + w, s.tpm_base + w,
            k.abandoned, k.hold, s.hold,
        )  # fmt: skip

    def release_keys(self, source: str) -> tuple[str, ...]:
        k, s, w = self.keys, self.keys.source(source), str(self.window)
        return (
            k.lease, s.lease, k.tpm_base + w, s.tpm_base + w, k.progress, k.abandoned,
            k.settled_base + w, k.hold, s.hold,
        )  # fmt: skip

    def acquire_args(self, source: str, lease: str, est: int) -> tuple[str, ...]:
        return (str(self.window), lease, str(est), str(LEASE_TTL_MS), *map(str, LIMITS[source]))

    def window_end(self) -> str:
        return str((self.window + 1) * 60)


def build_ops(rng: random.Random, scenario: Scenario, ids: list[str]) -> list[Op]:
    """A random sequence of every operation, with re-sent and unknown lease ids, refusals by
    each gate, settles, compensations and a breaker whose cooldown is over. ``ids`` are the
    lease and probe ids to use, in order (the same for both runs)."""
    fresh = iter(ids)
    leases: list[tuple[str, str]] = []  # (source, lease id) sent in an acquire
    ops: list[Op] = []
    for _ in range(48):
        source = rng.choice(SOURCES)
        kind = rng.choice(KINDS)
        if kind in ("acquire", "gate_acquire"):
            lease = rng.choice(leases)[1] if leases and rng.random() < 0.15 else next(fresh)
            leases.append((source, lease))
            keys = scenario.acquire_keys(source)
            args = scenario.acquire_args(source, lease, rng.randrange(100, 2_000))
            if kind == "acquire":
                ops.append(Op(1, keys, args))
            else:
                gate_args = (next(fresh), str(PROBE_TTL_MS), str(GATE_KEY_TTL_MS))
                ops.append(Op(6, (scenario.gate(source),), gate_args, keys, args))
        elif kind == "release":
            if leases and rng.random() < 0.8:
                source, lease = rng.choice(leases)
            else:
                lease = next(fresh)  # never acquired: a compensation marks it abandoned
            # The acquire's answer time, known (up to 4 s ago) or not (a compensation's): taken
            # from the lease id's hex digits, so that the random sequence stays that of the seed.
            known = int(lease[-4], 16) >= 5
            acquired = str(scenario.now_ms - int(lease[-3:], 16)) if known else "0"
            args = (
                lease, str(rng.randrange(-900, 900)), rng.choice("01"), rng.choice("01"),
                str(LEASE_TTL_MS), scenario.window_end(), acquired,
            )  # fmt: skip
            ops.append(Op(2, scenario.release_keys(source), args))
        elif kind == "settle" and leases:
            source, lease = rng.choice(leases)
            w = str(scenario.window)
            k, s = scenario.keys, scenario.keys.source(source)
            keys = (k.tpm_base + w, s.tpm_base + w, k.settled_base + w)
            ops.append(Op(3, keys, (str(rng.randrange(-500, 500)), lease, scenario.window_end())))
        elif kind == "mark":
            ops.append(Op(4, (scenario.keys.progress,), ()))
        else:
            args = (next(fresh), str(PROBE_TTL_MS), str(GATE_KEY_TTL_MS))
            ops.append(Op(5, (scenario.gate(source),), args))
    return ops


async def run_as_batch(redis: Any, ops: list[Op]) -> list[Any]:
    """One BATCH call: per operation its code, its arguments and where its keys start; each
    group of keys once."""
    keys: list[str] = []
    args: list[str] = []
    for op in ops:
        op_keys = list(op.keys + op.acquire_keys)
        start = next(
            (i for i in range(len(keys)) if keys[i : i + len(op_keys)] == op_keys), len(keys)
        )
        if start == len(keys):
            keys += op_keys
        args += [str(op.code), *op.args, *op.acquire_args, str(start)]
    flat = list(await _run(redis, BATCH, keys, args))
    assert len(flat) == sum(BATCH_REPLY_FIELDS[op.code] for op in ops)
    replies: list[Any] = []
    for op in ops:
        width = BATCH_REPLY_FIELDS[op.code]
        fields, flat = flat[:width], flat[width:]
        if op.code == 6:
            gate = BATCH_REPLY_FIELDS[5]
            replies.append([fields[:gate], fields[gate:]])
        else:
            replies.append(fields[0] if width == 1 else fields)
    return replies


async def run_one_by_one(redis: Any, ops: list[Op]) -> list[Any]:
    scripts = {1: ACQUIRE, 2: RELEASE, 3: SETTLE, 4: PROGRESS_MARK, 5: GATE_TRY_ENTER}
    replies = []
    for op in ops:
        if op.code == 6:
            gate = await _run(redis, GATE_TRY_ENTER, op.keys, op.args)
            admitted = gate[0] and await _run(redis, ACQUIRE, op.acquire_keys, op.acquire_args)
            replies.append([gate, padded(admitted or [], BATCH_REPLY_FIELDS[1])])
        elif op.code == 1:
            reply = await _run(redis, ACQUIRE, op.keys, op.args)
            replies.append(padded(reply, BATCH_REPLY_FIELDS[1]))
        else:
            replies.append(await _run(redis, scripts[op.code], op.keys, op.args))
    return replies


def padded(reply: list[Any], width: int) -> list[Any]:
    """A script's reply as the batch answers it: ``width`` fields, the missing ones 0."""
    return [*reply, *[0] * (width - len(reply))]


async def _run(redis: Any, script: LuaScript, keys: Any, args: Any) -> Any:
    return await redis.evalsha(script.sha, len(keys), *keys, *args)


def same_reply(op: Op, batched: Any, alone: Any) -> bool:
    if op.code in (1, 6):
        if op.code == 6:
            return same_gate_reply(batched[0], alone[0]) and same_acquire_reply(
                batched[1], alone[1]
            )
        return same_acquire_reply(batched, alone)
    if op.code == 5:
        return same_gate_reply(batched, alone)
    return bool(batched == alone)


def same_acquire_reply(batched: list[Any], alone: list[Any]) -> bool:
    """``{1, now, 0}``, ``{-2, now, 0}``, ``{0, gate, wait ms}``, or zeros where the gate
    refused: times compared loosely."""
    if batched[0] != alone[0] or len(batched) != len(alone):
        return False
    if batched[0] == 0:
        return bool(batched[1] == alone[1] and close(batched[2], alone[2]))
    return close(batched[1], alone[1]) and batched[2] == alone[2]


def same_gate_reply(batched: list[Any], alone: list[Any]) -> bool:
    """``{allowed, state, epoch, failures, owner, wait ms}``."""
    return bool(batched[:5] == alone[:5] and close(batched[5], alone[5]))


def close(a: Any, b: Any) -> bool:
    return abs(int(a) - int(b)) <= TIME_TOLERANCE_MS


TIME_VALUED = ("hold_ms", "progress_ms")


async def state_of(redis: Any, scope: str) -> dict[str, tuple[str, Any, int]]:
    """Every key of the scope, named without the scope: its type, its value and its TTL."""
    tag = LimiterKeys.for_scope(scope).tag
    state: dict[str, tuple[str, Any, int]] = {}
    async for key in redis.scan_iter(match=f"*{tag}*"):
        kind = await redis.type(key)
        if kind == "string":
            value: Any = await redis.get(key)
        elif kind == "zset":
            value = dict(await redis.zrange(key, 0, -1, withscores=True))
        elif kind == "set":
            value = await redis.smembers(key)
        else:
            value = await redis.hgetall(key)
        state[key.replace(tag, "{scope}")] = (kind, value, await redis.pttl(key))
    return state


def assert_same_state(batched: dict[str, Any], alone: dict[str, Any]) -> None:
    assert batched.keys() == alone.keys()
    for key, (kind, value, ttl) in batched.items():
        alone_kind, alone_value, alone_ttl = alone[key]
        assert kind == alone_kind, key
        # No key without an expiry, and the same expiry up to the time between the runs.
        assert ttl > 0 and alone_ttl > 0, (key, ttl, alone_ttl)
        assert close(ttl, alone_ttl), (key, ttl, alone_ttl)
        if kind == "zset":
            assert value.keys() == alone_value.keys(), key
            assert all(close(value[m], alone_value[m]) for m in value), key
        elif kind == "hash":
            assert value.keys() == alone_value.keys(), key
            for field, item in value.items():
                if field.endswith("_until"):
                    assert close(item, alone_value[field]), (key, field)
                else:
                    assert item == alone_value[field], (key, field)
        elif key.endswith(TIME_VALUED):
            assert close(value, alone_value), (key, value, alone_value)
        else:
            assert value == alone_value, key


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Any]:
    client = Redis.from_url(redis_url, decode_responses=True)
    try:
        for script in (ACQUIRE, RELEASE, SETTLE, PROGRESS_MARK, GATE_TRY_ENTER, BATCH):
            await client.script_load(script.source)
        yield client
    finally:
        await client.aclose()


async def prepare(redis: Any, scenario: Scenario) -> None:
    """The same starting point for both runs: leases held and a window partly used, a breaker
    open with its cooldown over (the first gate step makes its caller the probe), and a
    lease id given up by a cancelled caller."""
    k = scenario.keys
    s1 = k.source("s1")
    now_ms = int((await redis.time())[0]) * 1000
    w = str(scenario.window)
    for lease in ("held-a", "held-b"):
        for key in (k.lease, s1.lease):
            await redis.zadd(key, {lease: now_ms + LEASE_TTL_MS})
            await redis.pexpire(key, LEASE_TTL_MS)
    for key, value in ((k.rpm_base + w, 3), (k.tpm_base + w, 2_500), (s1.hold, 40)):
        await redis.set(key, value, ex=120)
    await redis.zadd(k.abandoned, {"given-up": now_ms + LEASE_TTL_MS})
    await redis.pexpire(k.abandoned, LEASE_TTL_MS)
    await redis.hset(
        scenario.gate("s2"),
        mapping={"state": "open", "epoch": 3, "failures": 5, "open_until": now_ms - 1},
    )
    await redis.pexpire(scenario.gate("s2"), GATE_KEY_TTL_MS)


@pytest.mark.parametrize("seed", range(6))
async def test_a_batch_decides_and_leaves_what_its_operations_would_one_by_one(
    redis: Any, unique_scope: str, seed: int
) -> None:
    for _attempt in range(2):  # a run that straddles a minute is run again in the next one
        seconds, micros = await redis.time()
        window, now_ms = int(seconds) // 60, int(seconds) * 1000 + int(micros) // 1000
        batched_scope, alone_scope = f"{unique_scope}b{seed}", f"{unique_scope}a{seed}"
        ids = [new_lease_id() if i % 3 else new_id() for i in range(200)]
        batched_scenario = Scenario(batched_scope, window, now_ms)
        alone_scenario = Scenario(alone_scope, window, now_ms)
        batched_ops = build_ops(random.Random(seed), batched_scenario, ids)
        alone_ops = build_ops(random.Random(seed), alone_scenario, ids)
        await prepare(redis, batched_scenario)
        await prepare(redis, alone_scenario)
        batched = await run_as_batch(redis, batched_ops)
        alone = await run_one_by_one(redis, alone_ops)
        if int((await redis.time())[0]) // 60 == window:
            break
    assert len(batched) == len(alone) == len(batched_ops)
    for op, b, a in zip(batched_ops, batched, alone, strict=True):
        assert same_reply(op, b, a), (op, b, a)
    # The scenario reaches what it is for: refusals, admissions, a probe, compensations.
    codes = [r[0] for op, r in zip(batched_ops, batched, strict=True) if op.code == 1]
    assert 1 in codes and 0 in codes, codes
    assert_same_state(await state_of(redis, batched_scope), await state_of(redis, alone_scope))


async def test_an_operation_that_fails_leaves_the_batch_s_earlier_writes_whole(
    redis: Any, unique_scope: str
) -> None:
    """The deferred writes (counters, expiries) land even when a later operation fails."""
    window = int((await redis.time())[0]) // 60
    scenario = Scenario(unique_scope, window)
    lease = new_lease_id()
    good = Op(1, scenario.acquire_keys("s1"), scenario.acquire_args("s1", lease, 100))
    bad = Op(1, scenario.acquire_keys("s1"), (str(window), new_lease_id(), "not a number"))
    with pytest.raises(Exception, match=r"attempt to (compare|perform arithmetic)"):
        await run_as_batch(redis, [good, bad])
    state = await state_of(redis, unique_scope)
    assert state, "the first acquire wrote nothing"
    assert all(ttl > 0 for _kind, _value, ttl in state.values()), state
    rpm = state[f"pgw:limit:{{scope}}:global:rpm:{window}"]
    assert rpm[1] == "1"


async def test_a_counter_that_cannot_be_incremented_leaves_no_lease_set_without_expiry(
    redis: Any, unique_scope: str
) -> None:
    """A window counter holding something else than an integer fails the batch's flush, as it
    fails the single script: the lease sets written before it keep their expiry all the same."""
    window = int((await redis.time())[0]) // 60
    scenario = Scenario(unique_scope, window)
    await redis.set(scenario.keys.rpm_base + str(window), "not a count", ex=120)
    acquire = Op(1, scenario.acquire_keys("s1"), scenario.acquire_args("s1", new_lease_id(), 100))
    with pytest.raises(Exception, match="not an integer"):
        await run_as_batch(redis, [acquire])
    state = await state_of(redis, unique_scope)
    leases = [key for key, (kind, _value, _ttl) in state.items() if kind == "zset"]
    assert len(leases) == 2, state
    assert all(ttl > 0 for _kind, _value, ttl in state.values()), state


@pytest.mark.parametrize("form", ["alone", "batch"])
@pytest.mark.parametrize("gates", ["admit", "refuse"])
async def test_an_acquire_re_sent_with_its_lease_id_admits_once(
    redis: Any, unique_scope: str, form: str, gates: str
) -> None:
    """A command re-sent after a lost reply: the second run answers admitted and charges
    nothing more, whether the gates would now let a new lease in or not (with a concurrency
    limit of 1 the lease itself fills it)."""
    for attempt in range(2):  # a run that straddles a minute is run again in the next one
        window = int((await redis.time())[0]) // 60
        scenario = Scenario(f"{unique_scope}{attempt}", window)
        lease = new_lease_id()
        limit = "1" if gates == "refuse" else "5"
        args = (str(window), lease, "100", str(LEASE_TTL_MS), limit, "0", "0", "0", "0", "0")
        op = Op(1, scenario.acquire_keys("s1"), args)
        replies = []
        for _ in range(2):
            if form == "batch":
                (reply,) = await run_as_batch(redis, [op])
            else:
                reply = await _run(redis, ACQUIRE, op.keys, op.args)
            replies.append(reply)
        if int((await redis.time())[0]) // 60 == window:
            break
    assert [r[0] for r in replies] == [1, 1], replies
    k, w = scenario.keys, str(window)
    assert await redis.zcard(k.lease) == 1
    assert await redis.zcard(k.source("s1").lease) == 1
    assert await redis.get(k.rpm_base + w) == "1"
    assert await redis.get(k.tpm_base + w) == "100"
    # A new lease id is refused by a full gate, or admitted beside it.
    other = Op(1, op.keys, (args[0], new_lease_id(), *args[2:]))
    (reply,) = await run_as_batch(redis, [other])
    assert reply[0] == (0 if gates == "refuse" else 1), reply
