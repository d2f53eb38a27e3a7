"""The soak scoreboard's invariant functions: each passes on a clean record and fails on the
violation it exists to catch."""

from __future__ import annotations

import json
from typing import Any

import invariants as inv

SOURCES: list[dict[str, Any]] = [
    {
        "fake": "ok",
        "scope": "LLM",
        "client": "openai-1",
        "fault": "healthy",
        "max_concurrency": 4,
        "rpm": 0,
        "tpm": 0,
    },
    {
        "fake": "tight",
        "scope": "LLM",
        "client": "openai-2",
        "fault": "tight",
        "max_concurrency": 2,
        "rpm": 5,
        "tpm": 100,
    },
    {
        "fake": "dead",
        "scope": "LLM",
        "client": "openai-3",
        "fault": "dead",
        "max_concurrency": 0,
        "rpm": 0,
        "tpm": 0,
    },
    {
        "fake": "vec",
        "scope": "EMBED",
        "client": "generic-1",
        "fault": "healthy",
        "max_concurrency": 0,
        "rpm": 0,
        "tpm": 0,
    },
    {
        "fake": "ocr-b",
        "scope": "OCR",
        "client": "monkey-1",
        "fault": "healthy",
        "max_concurrency": 1,
        "rpm": 0,
        "tpm": 0,
    },
]
T0 = 600.0 * 1000  # the start of a minute window


def arrival(
    t: float, source: str, tag: str | None, tokens: int = 10, route: str = "chat"
) -> dict[str, Any]:
    return {
        "t": t,
        "source": source,
        "route": route,
        "tag": tag,
        "kind": "ok",
        "prompt_tokens": tokens,
        "completion_tokens": 0,
    }


def row(
    source: str,
    tag: str | None,
    *,
    scope: str = "LLM",
    hit: bool = False,
    cost: float | None = 0.0,
    **extra: Any,
) -> dict[str, Any]:
    messages = json.dumps([{"role": "user", "content": f"[tag:{tag}] x" if tag else "x"}])
    base = {
        "scope": scope,
        "source_name": source,
        "messages": messages,
        "cache_hit": hit,
        "error": None,
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "cost": cost,
        "model": "m",
        "cache_namespace": "run",
    }
    return base | extra


def phase(peaks: dict[str, int], star: int, checked: bool = True) -> dict[str, Any]:
    return {"phase": "final", "checked": checked, "max_inflight": {"chat": {"*": star, **peaks}}}


# -- 1 limits ---------------------------------------------------------------------------------


def test_limits_pass_at_the_limit_and_fail_above_it() -> None:
    arrivals = [arrival(T0 + 2 + i, "tight", f"w0-{i}", tokens=20) for i in range(5)]
    ok = inv.check_limits(
        arrivals, SOURCES, [phase({"tight": 2, "ok": 4}, 6)], {"ocr-b": {"max_inflight": 1}}, 10, 0
    )
    assert ok.ok, ok.details
    over = [*arrivals, arrival(T0 + 30, "tight", "w0-9")]
    bad = inv.check_limits(over, SOURCES, [], {}, 10, 0)
    assert not bad.ok and "6 requests in minute window" in bad.details[0]


def test_limits_check_tokens_concurrency_and_the_global_gates() -> None:
    heavy = [
        arrival(T0 + 2, "tight", "w0-1", tokens=60),
        arrival(T0 + 3, "tight", "w0-2", tokens=60),
    ]
    assert "tokens" in inv.check_limits(heavy, SOURCES, [], {}, 10, 0).details[0]
    peak = inv.check_limits([], SOURCES, [phase({"tight": 3}, 3)], {}, 10, 0)
    assert not peak.ok and "tight: 3 in flight > 2" in peak.details[0]
    star = inv.check_limits([], SOURCES, [phase({}, 11)], {}, 10, 0)
    assert not star.ok and "global 10" in star.details[0]
    # A phase that is not checked (a Redis restart's transition) does not count.
    assert inv.check_limits([], SOURCES, [phase({"tight": 9}, 99, checked=False)], {}, 10, 0).ok
    ocr = inv.check_limits([], SOURCES, [], {"ocr-b": {"max_inflight": 2}}, 10, 0)
    assert not ocr.ok and "ocr-b" in ocr.details[0]
    many = [arrival(T0 + 2 + i * 0.1, "ok", f"w0-{i}") for i in range(4)]
    assert not inv.check_limits(many, SOURCES, [], {}, 10, 3).ok  # global RPM 3


def test_limit_windows_leave_out_the_admission_lag_and_allow_twice_after_a_reset() -> None:
    # Requests admitted at the end of one minute may arrive in the next one's first second.
    spill = [arrival(T0 + 0.2 + i * 0.01, "tight", f"w0-{i}") for i in range(3)]
    spill += [arrival(T0 + 10 + i, "tight", f"w0-{10 + i}") for i in range(5)]
    assert inv.check_limits(spill, SOURCES, [], {}, 10, 0).ok
    burst = [arrival(T0 + 5 + i, "tight", f"w0-{i}") for i in range(10)]
    assert not inv.check_limits(burst, SOURCES, [], {}, 10, 0).ok
    assert inv.check_limits(burst, SOURCES, [], {}, 10, 0, resets=[(T0 + 8, T0 + 12)]).ok


def test_window_helpers() -> None:
    assert inv.window_counts([(T0 + 0.5, 1.0), (T0 + 2, 1.0), (T0 + 61.5, 2.0)]) == {
        10000: 1.0,
        10001: 2.0,
    }
    assert inv.max_sliding([0, 10, 59.9, 60, 61, 200]) == 4


# -- 2 rows -----------------------------------------------------------------------------------


def test_rows_match_arrivals_one_to_one() -> None:
    arrivals = [
        arrival(1, "ok", "w0-1"),
        arrival(2, "ok", "w0-1"),
        arrival(3, "vec", "w0-2", route="embeddings"),
    ]
    rows = [
        row("openai-1", "w0-1"),
        row("openai-1", "w0-1"),
        row("generic-1", "w0-2", scope="EMBED"),
    ]
    rows += [row("openai-1", "w0-1", hit=True), row("", "w0-9", error="AllSourcesExhausted")]
    ok = inv.check_rows(arrivals, rows, SOURCES, {})
    assert ok.ok, ok.details
    assert ok.numbers["arrivals"] == 3


def test_rows_catch_a_lost_a_duplicated_and_a_foreign_row() -> None:
    arrivals = [arrival(1, "ok", "w0-1"), arrival(2, "ok", "w0-2")]
    lost = inv.check_rows(arrivals, [row("openai-1", "w0-1")], SOURCES, {})
    assert not lost.ok and "without a row" in lost.details[0]
    dup = inv.check_rows(
        arrivals, [row("openai-1", "w0-1")] * 2 + [row("openai-1", "w0-2")], SOURCES, {}
    )
    assert not dup.ok and "without an arrival" in dup.details[0]
    wrong_source = inv.check_rows(arrivals[:1], [row("openai-2", "w0-1")], SOURCES, {})
    assert not wrong_source.ok


def test_rows_allow_counted_drops_and_killed_workers() -> None:
    arrivals = [arrival(1, "ok", "w0-1"), arrival(2, "ok", "w1-1"), arrival(3, "ok", "w0-2")]
    rows = [row("openai-1", "w0-1")]
    assert not inv.check_rows(arrivals, rows, SOURCES, {}, excluded_workers=["w1"]).ok
    assert inv.check_rows(arrivals, rows, SOURCES, {}, excluded_workers=["w1"], dropped=1).ok
    assert not inv.check_rows(arrivals, rows, SOURCES, {}, dropped=1).ok


def test_rows_count_ocr_per_source_and_refuse_untagged_arrivals() -> None:
    ocr_rows = [row("monkey-1", None, scope="OCR")] * 2
    assert inv.check_rows([], ocr_rows, SOURCES, {"ocr-b": {"uploads": 2}}).ok
    assert not inv.check_rows([], ocr_rows, SOURCES, {"ocr-b": {"uploads": 3}}).ok
    untagged = inv.check_rows([arrival(1, "ok", None)], [row("openai-1", None)], SOURCES, {})
    assert not untagged.ok and "no tag" in untagged.details[-1]


# -- 3 redis ----------------------------------------------------------------------------------


def test_redis_leftovers() -> None:
    clean = {
        "now_ms": 1000,
        "keys": [
            {
                "key": "pgw:limit:{LLM}:global:lease",
                "type": "zset",
                "pttl": 5000,
                "members": [["a", 900]],
            },
            {
                "key": "pgw:gate:{LLM}:x",
                "type": "hash",
                "pttl": 9000,
                "hash": {"probe_owner": "p", "probe_until": "500"},
            },
        ],
    }
    assert inv.check_redis(clean).ok
    live = {
        "now_ms": 1000,
        "keys": [
            {
                "key": "pgw:limit:{LLM}:source:x:lease",
                "type": "zset",
                "pttl": 5000,
                "members": [["a", 1500]],
            }
        ],
    }
    assert not inv.check_redis(live).ok
    no_ttl = {
        "now_ms": 1000,
        "keys": [{"key": "pgw:limit:{LLM}:global:rpm:1", "type": "string", "pttl": -1}],
    }
    assert "no TTL" in inv.check_redis(no_ttl).details[0]
    probe = {
        "now_ms": 1000,
        "keys": [
            {
                "key": "pgw:gate:{LLM}:x",
                "type": "hash",
                "pttl": 9000,
                "hash": {"probe_owner": "p", "probe_until": "2000"},
            }
        ],
    }
    assert not inv.check_redis(probe).ok
    assert not inv.check_redis({"error": "down", "keys": []}).ok


# -- 4 breakers -------------------------------------------------------------------------------


def test_probe_spacing_after_the_opening_burst() -> None:
    burst, close, opened = inv.probe_spacing([0, 0.1, 0.2, 10.5, 21, 31.5], 10)
    assert (burst, close, opened) == (3, [], True)
    _, close, _ = inv.probe_spacing([0, 0.1, 10.5, 12, 25], 10)
    assert close == [(10.5, 12)]
    # A reset (Redis restart) forgets the breaker: a new burst is allowed.
    burst, close, _ = inv.probe_spacing([0, 11, 30, 30.1, 30.2, 41], 10, resets=[(29, 29.5)])
    assert close == [] and burst == 4


def test_breakers_fail_on_close_probes_big_bursts_and_never_opening() -> None:
    def times(*ts: float) -> list[dict[str, Any]]:
        return [arrival(t, "dead", f"w0-{i}") for i, t in enumerate(ts)]

    assert inv.check_breakers(times(0, 0.1, 10.2, 20.4), SOURCES, 10, 60, 5).ok
    assert not inv.check_breakers(times(0, 10.2, 11), SOURCES, 10, 60, 5).ok
    assert not inv.check_breakers(times(*[i * 0.1 for i in range(10)], 20), SOURCES, 10, 60, 5).ok
    steady = times(*[i * 2.0 for i in range(30)])
    assert "never opened" in inv.check_breakers(steady, SOURCES, 10, 60, 100).details[0]
    # A pause cut short by a Redis restart (which forgets the breaker) still shows it opened.
    restart = [(30.0, 34.0)]
    cut = times(0, 0.5, 1, 1.5, 31, 31.5, 32, 32.5)
    assert inv.check_breakers(cut, SOURCES, 10, 60, 10, restart).ok
    assert "never opened" in inv.check_breakers(steady, SOURCES, 10, 60, 100, restart).details[0]


def test_a_probe_handed_back_without_a_verdict_lets_the_next_arrive_at_once() -> None:
    # The probe of 20.0 was cut by its call's deadline 0.4 s later (before the earliest
    # verdict, 1.5 s): the next caller became the probe at once.
    burst, close, _ = inv.probe_spacing([0, 0.1, 20.0, 20.5, 31], 10, handbacks=[20.4])
    assert (burst, close) == (2, [])
    black_hole = [{**SOURCES[2], "fake": "hole", "fault": "black_hole"}]
    arrivals = [arrival(t, "hole", f"w0-{i}") for i, t in enumerate((0, 0.1, 20.0, 20.5, 31))]
    cut = {"w0-2": 20.4}
    assert inv.check_breakers(arrivals, black_hole, 10, 60, 5, (), cut, 1.5).ok
    # Ended after the earliest verdict: the probe failed, and the breaker reopened.
    late = {"w0-2": 21.6}
    assert not inv.check_breakers(arrivals, black_hole, 10, 60, 20, (), late, 1.5).ok
    # Without the deadlines (an older run) nothing is excused.
    assert not inv.check_breakers(arrivals, black_hole, 10, 60, 5, (), cut).ok
    # A dead source answers with its verdict at once: a call ending soon after is no hand-back.
    dead = [arrival(t, "dead", f"w0-{i}") for i, t in enumerate((0, 0.1, 20.0, 20.5, 31))]
    assert not inv.check_breakers(dead, SOURCES, 10, 60, 5, (), cut, 1.5).ok


# -- 5 outcomes -------------------------------------------------------------------------------


def call(tag: str, outcome: str = "ok", **extra: Any) -> dict[str, Any]:
    return {"tag": tag, "scenario": "P1", "t": 0.0, "dur": 1.0, "outcome": outcome, **extra}


def test_outcomes() -> None:
    good = [call("w0-1"), call("w0-2", "error", error="AllSourcesExhausted", classified=True)]
    assert inv.check_outcomes(good, 20).ok
    assert not inv.check_outcomes(
        [call("w0-1", "error", error="KeyError", classified=False)], 20
    ).ok
    assert not inv.check_outcomes([call("w0-1", dur=23.0)], 20).ok
    assert not inv.check_outcomes(
        [call("w0-1", "error", error="hang", classified=False, hang=True)], 20
    ).ok
    killed = [call("w1-1", "error", error="KeyError", classified=False)]
    assert inv.check_outcomes(killed, 20, excluded_workers=["w1"]).ok


# -- 6 cache and cost -------------------------------------------------------------------------


def rep(t: float, tenant: str, hit: bool, tag: str = "w0-r1") -> dict[str, Any]:
    return call(tag, t=t, dur=0.5, tenant=tenant, cache_hit=hit)


PRICES = {"m": {"input_per_1m": 1.0, "output_per_1m": 2.0}}


def test_cache_hits_within_a_tenant_only() -> None:
    calls = [rep(0, "A", False), rep(5, "A", True), rep(6, "B", False), rep(9, "B", True)]
    ok = inv.check_cache(calls, [], PRICES)
    assert ok.ok, ok.details
    foreign = inv.check_cache([rep(0, "A", False), rep(5, "B", True)], [], PRICES)
    assert not foreign.ok and "never stored" in foreign.details[0]
    missed = inv.check_cache(
        [rep(0, "A", False), rep(5, "A", False), rep(9, "A", True)], [], PRICES
    )
    assert not missed.ok and missed.numbers["missed"] == 1
    # After a reset (Redis restart clears the cache) a miss is expected.
    reset = inv.check_cache(
        [rep(0, "A", False), rep(5, "A", False), rep(9, "A", True)], [], PRICES, resets=[(2, 3)]
    )
    assert reset.ok, reset.details
    assert not inv.check_cache([rep(0, "A", False)], [], PRICES).ok  # no hit at all


def test_cost_matches_the_price_table() -> None:
    calls = [rep(0, "A", False), rep(5, "A", True)]
    rows = [
        row("openai-1", "w0-1", prompt_tokens=1000, completion_tokens=500, cost=0.002),
        row("openai-1", "w0-1", hit=True, cost=0.0),
        row("openai-1", "w0-1", model="unpriced", cost=None),
    ]
    ok = inv.check_cache(calls, rows, PRICES)
    assert ok.ok, ok.details
    bad = inv.check_cache(calls, [row("openai-1", "w0-1", prompt_tokens=1000, cost=0.5)], PRICES)
    assert not bad.ok and bad.numbers["rows with wrong cost"] == 1
