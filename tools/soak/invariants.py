"""The six hard invariants of a soak run, as pure functions over what the run recorded
(unit-tested in tests/soak). Each returns a :class:`Verdict`: ok, a one-line summary and the
details (every violation, capped).

Inputs (all plain dicts, as the files of a run directory hold them):

- arrivals: the fake upstream's log lines (``t`` wall seconds, ``source``, ``route``, ``tag``,
  ``kind``, ``prompt_tokens``, ``completion_tokens``);
- rows: telemetry rows (``scope``, ``source_name``, ``messages``, ``cache_hit``, ``error``,
  ``prompt_tokens``, ``completion_tokens``, ``cost``, ``model``, ``cache_namespace``);
- calls: the workers' call lines (``tag``, ``scenario``, ``t``, ``dur``, ``outcome``,
  ``error``, ``classified``, ``hang``, ``cache_hit``, ``tenant``);
- sources: ``fleet.source_table()``; limits: ``run.json``'s ``limits``.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from corpus import tag_of

MAX_DETAILS = 20
WINDOW_S = 60.0
ARRIVAL_LAG_S = 1.0
"""An arrival can follow its admission by this much (the first second of a minute window
may hold requests admitted in the previous one)."""
SPACING_TOLERANCE = 0.9
"""Probes must be at least this fraction of the cooldown apart (host and Redis clocks,
scheduling)."""
DEADLINE_SLACK_S = 2.0
COST_TOLERANCE = 1e-9


@dataclass
class Verdict:
    name: str
    ok: bool
    summary: str
    details: list[str] = field(default_factory=list)
    numbers: dict[str, Any] = field(default_factory=dict)

    def add(self, text: str) -> None:
        if len(self.details) < MAX_DETAILS:
            self.details.append(text)


def worker_of(tag: str | None) -> str | None:
    """``w3`` of ``w3-17`` / ``w3-r4``."""
    if not tag or "-" not in tag:
        return None
    return tag.split("-", 1)[0]


def window_counts(
    times_and_weights: Iterable[tuple[float, float]], lag_s: float = ARRIVAL_LAG_S
) -> dict[int, float]:
    """Sum of weights per minute window ``floor(t / 60)``, leaving out the first ``lag_s`` of
    each window (arrivals there may belong to the previous window's admissions)."""
    out: dict[int, float] = defaultdict(float)
    for t, weight in times_and_weights:
        window = math.floor(t / WINDOW_S)
        if t - window * WINDOW_S >= lag_s:
            out[window] += weight
    return dict(out)


def max_sliding(times: Sequence[float], span_s: float = WINDOW_S) -> int:
    """The most arrivals in any interval of ``span_s`` seconds."""
    ordered = sorted(times)
    best = 0
    lo = 0
    for hi, t in enumerate(ordered):
        while t - ordered[lo] >= span_s:
            lo += 1
        best = max(best, hi - lo + 1)
    return best


def _in_any(t: float, spans: Sequence[tuple[float, float]]) -> bool:
    return any(a <= t < b for a, b in spans)


def _window_spans(spans: Sequence[tuple[float, float]]) -> set[int]:
    """Minute windows touched by any of ``spans``."""
    out: set[int] = set()
    for a, b in spans:
        out.update(range(math.floor(a / WINDOW_S), math.floor(b / WINDOW_S) + 1))
    return out


ROUTE_OF_SCOPE = {"LLM": "chat", "EMBED": "embeddings"}


def check_limits(
    arrivals: Sequence[Mapping[str, Any]],
    sources: Sequence[Mapping[str, Any]],
    counter_phases: Sequence[Mapping[str, Any]],
    ocr_counters: Mapping[str, Mapping[str, int]],
    global_concurrency: int,
    global_rpm: int,
    resets: Sequence[tuple[float, float]] = (),
) -> Verdict:
    """1. No global or per-source limit exceeded as the upstream saw it: max in flight (per
    checked counter phase), requests and tokens per minute window (the limiter's fixed
    windows: a window never holds more than the limit; any 60 s span may hold up to twice it,
    which is reported). Windows touched by a governance reset (a Redis restart, which clears
    the counters by design) may hold twice the limit."""
    v = Verdict("1 limits", True, "")
    reset_windows = _window_spans(resets)
    checked = [p for p in counter_phases if p.get("checked")]
    worst: dict[str, Any] = {}
    for phase in checked:
        peaks = phase.get("max_inflight", {})
        for scope, route in ROUTE_OF_SCOPE.items():
            peak = peaks.get(route, {}).get("*", 0)
            worst[f"{scope} in flight"] = max(worst.get(f"{scope} in flight", 0), peak)
            if global_concurrency and peak > global_concurrency:
                v.ok = False
                v.add(
                    f"{scope}: {peak} in flight at the upstream > global "
                    f"{global_concurrency} ({phase['phase']})"
                )
        for s in sources:
            source_route = ROUTE_OF_SCOPE.get(s["scope"])
            if source_route is None or not s["max_concurrency"]:
                continue
            peak = peaks.get(source_route, {}).get(s["fake"], 0)
            worst[f"{s['fake']} in flight"] = max(worst.get(f"{s['fake']} in flight", 0), peak)
            if peak > s["max_concurrency"]:
                v.ok = False
                v.add(f"{s['fake']}: {peak} in flight > {s['max_concurrency']} ({phase['phase']})")
    for s in sources:
        if s["scope"] == "OCR" and s["max_concurrency"]:
            peak = ocr_counters.get(s["fake"], {}).get("max_inflight", 0)
            worst[f"{s['fake']} in flight"] = peak
            if peak > s["max_concurrency"]:
                v.ok = False
                v.add(f"{s['fake']}: {peak} in flight > {s['max_concurrency']}")
    by_source: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    by_route: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for a in arrivals:
        by_source[a["source"]].append(a)
        by_route[a["route"]].append(a)

    def windows(name: str, items: Sequence[Mapping[str, Any]], limit: int, tokens: bool) -> None:
        if not limit:
            return
        weights = (
            (a["t"], float(a["prompt_tokens"] + a["completion_tokens"]) if tokens else 1.0)
            for a in items
        )
        counts = window_counts(weights)
        top = max(counts.values(), default=0)
        what = "tokens" if tokens else "requests"
        worst[f"{name} {what}/window"] = f"{top:g} / {limit}" + (
            f" ({2 * limit} in a window a Redis restart touched)" if reset_windows else ""
        )
        for window, count in sorted(counts.items()):
            allowed = 2 * limit if window in reset_windows else limit
            if count > allowed:
                v.ok = False
                v.add(f"{name}: {count:g} {what} in minute window {window} > {allowed}")
        if not tokens:
            sliding = max_sliding([a["t"] for a in items])
            bound = 2 * limit * (2 if reset_windows else 1)
            restart = " with a Redis restart" if reset_windows else ""
            worst[f"{name} requests/any 60 s"] = f"{sliding} (bound {bound}{restart})"
            if sliding > bound:
                v.ok = False
                v.add(f"{name}: {sliding} requests within 60 s > the fixed-window bound {bound}")

    for s in sources:
        items = by_source.get(s["fake"], [])
        windows(s["fake"], items, s["rpm"], tokens=False)
        windows(s["fake"], items, s["tpm"], tokens=True)
    for scope, route in ROUTE_OF_SCOPE.items():
        windows(f"{scope} global", by_route.get(route, []), global_rpm, tokens=False)
    v.numbers = worst
    v.summary = (
        f"{len(checked)} counter phase(s), {len(arrivals)} arrivals checked"
        if v.ok
        else f"{len(v.details)} limit(s) exceeded"
    )
    return v


def attempt_rows(rows: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Rows of attempts that went to a source (not cache hits, not calls refused before any
    attempt, which have no source)."""
    return [r for r in rows if not r["cache_hit"] and r["source_name"]]


def check_rows(
    arrivals: Sequence[Mapping[str, Any]],
    rows: Sequence[Mapping[str, Any]],
    sources: Sequence[Mapping[str, Any]],
    ocr_counters: Mapping[str, Mapping[str, int]],
    *,
    excluded_workers: Iterable[str] = (),
    dropped: int = 0,
) -> Verdict:
    """2. Every attempt that reached the upstream has exactly one telemetry row and every
    attempt row a matching arrival: the multisets of (fake source, tag) agree. Workers killed
    mid-run are excluded (their buffered rows died with them). ``dropped``: rows the
    recorders said they dropped (a telemetry outage): that many arrivals may lack a row, no
    more, and no row may lack an arrival. OCR requests carry no tag: counts per source."""
    v = Verdict("2 telemetry rows", True, "")
    excluded = set(excluded_workers)
    fake_of = {(s["scope"], s["client"]): s["fake"] for s in sources}
    seen: Counter[tuple[str, str | None]] = Counter()
    for a in arrivals:
        if worker_of(a["tag"]) in excluded:
            continue
        seen[(a["source"], a["tag"])] += 1
    recorded: Counter[tuple[str, str | None]] = Counter()
    ocr_rows: Counter[str] = Counter()
    for r in attempt_rows(rows):
        fake = fake_of.get((r["scope"], r["source_name"]), f"?{r['scope']}:{r['source_name']}")
        if r["scope"] == "OCR":
            ocr_rows[fake] += 1
            continue
        tag = tag_of(r["messages"] or "")
        if worker_of(tag) in excluded:
            continue
        recorded[(fake, tag)] += 1
    missing = seen - recorded
    extra = recorded - seen
    n_missing = sum(missing.values())
    n_extra = sum(extra.values())
    for (fake, tag), n in sorted(extra.items(), key=str):
        v.add(f"{n} row(s) without an arrival: {fake} tag {tag}")
    if n_extra:
        v.ok = False
    if n_missing > dropped:
        v.ok = False
        for (fake, tag), n in sorted(missing.items(), key=str):
            v.add(f"{n} arrival(s) without a row: {fake} tag {tag}")
    ocr_missing = 0
    untagged = sum(n for (_, tag), n in seen.items() if tag is None)
    if untagged:
        v.ok = False
        v.add(f"{untagged} arrival(s) carry no tag")
    for s in sources:
        if s["scope"] != "OCR":
            continue
        uploads = ocr_counters.get(s["fake"], {}).get("uploads", 0)
        rows_n = ocr_rows[s["fake"]]
        if rows_n > uploads:
            v.ok = False
            v.add(f"{s['fake']}: {rows_n} rows for {uploads} uploads")
        elif rows_n < uploads:
            ocr_missing += uploads - rows_n
            # A killed worker's OCR uploads cannot be told apart (they carry no tag).
            if not excluded and n_missing + ocr_missing > dropped:
                v.ok = False
                v.add(f"{s['fake']}: {uploads} uploads, {rows_n} rows")
    v.numbers = {
        "arrivals": sum(seen.values()),
        "attempt rows": sum(recorded.values()),
        "OCR rows": sum(ocr_rows.values()),
        "missing rows": n_missing,
        "OCR uploads without a row": ocr_missing,
        "rows without arrival": n_extra,
        "dropped (recorders)": dropped,
    }
    v.summary = (
        f"{sum(seen.values())} tagged arrivals, {sum(recorded.values())} rows, "
        f"{sum(ocr_rows.values())} OCR rows ({ocr_missing} uploads without one); "
        f"{n_missing} tagged arrivals without a row "
        f"(recorders counted {dropped} dropped), {n_extra} rows without an arrival"
        + (f"; workers {sorted(excluded)} excluded (killed)" if excluded else "")
    )
    return v


def check_redis(snapshot: Mapping[str, Any]) -> Verdict:
    """3. After the run, no key without a TTL, no live lease, no held probe."""
    v = Verdict("3 redis leftovers", True, "")
    if "error" in snapshot:
        v.ok = False
        v.summary = f"no snapshot: {snapshot['error']}"
        return v
    now = snapshot["now_ms"]
    no_ttl = leases = probes = 0
    for entry in snapshot["keys"]:
        if entry["pttl"] == -1:
            no_ttl += 1
            v.add(f"no TTL: {entry['key']}")
        if entry["type"] == "zset" and entry["key"].endswith(":lease"):
            live = [m for m, score in entry.get("members", []) if float(score) > now]
            if live:
                leases += len(live)
                v.add(f"{len(live)} live lease(s) in {entry['key']}")
        if entry["type"] == "hash" and ":gate:" in entry["key"]:
            h = entry.get("hash", {})
            if h.get("probe_owner") and float(h.get("probe_until") or 0) > now:
                probes += 1
                v.add(f"probe still held: {entry['key']}")
    v.ok = not (no_ttl or leases or probes)
    v.numbers = {
        "keys": len(snapshot["keys"]),
        "no TTL": no_ttl,
        "live leases": leases,
        "held probes": probes,
    }
    v.summary = (
        f"{len(snapshot['keys'])} keys: {no_ttl} without TTL, {leases} live leases, "
        f"{probes} held probes"
    )
    return v


def probe_spacing(
    times: Sequence[float],
    cooldown_s: float,
    resets: Sequence[tuple[float, float]] = (),
    handbacks: Sequence[float] = (),
) -> tuple[int, list[tuple[float, float]], bool]:
    """(arrivals of the opening bursts, probes closer than the cooldown, opened).

    The breaker opens after a burst (the requests admitted before the first verdicts came
    back); from the first gap of a cooldown on, consecutive arrivals must be a cooldown
    apart. A governance reset (Redis restart) starts a new burst. ``handbacks``: times at which
    a probe went back without a verdict (its call ended while the probe was in flight): the
    next caller is the probe at once, so the arrival after one may come early."""
    ordered = sorted(times)
    min_gap = cooldown_s * SPACING_TOLERANCE
    burst = 0
    opened = False
    in_burst = True
    close: list[tuple[float, float]] = []
    for i, t in enumerate(ordered):
        if i and any(ordered[i - 1] < a <= t for a, _ in resets):
            in_burst = True  # the restart forgot the breaker state: a new burst starts here
            burst += 1
            continue
        gap = t - ordered[i - 1] if i else math.inf
        if in_burst:
            if i and gap >= min_gap:
                in_burst = False
                opened = True
            else:
                burst += 1
                continue
        if gap < min_gap and not any(ordered[i - 1] < h <= t for h in handbacks):
            close.append((ordered[i - 1], t))
    return burst, close, opened


def check_breakers(
    arrivals: Sequence[Mapping[str, Any]],
    sources: Sequence[Mapping[str, Any]],
    cooldown_s: float,
    run_end: float,
    burst_bound: int,
    resets: Sequence[tuple[float, float]] = (),
    call_ends: Mapping[str, float] | None = None,
    verdict_after_s: float = 0.0,
) -> Verdict:
    """4. Dead and black-holed sources are opened by the breaker and probed at most once per
    cooldown (per scope, all workers together), as the upstream saw it.

    A black hole never answers: its attempt gets a verdict (a timeout) ``verdict_after_s``
    after it arrived at the earliest (the shortest of the attempt deadlines). A call that
    ended (``call_ends``: tag -> wall time) sooner than that after its arrival was cut by its
    own deadline or cancelled with the attempt in flight, and its probe went back without a
    verdict: the next arrival may follow at once."""
    v = Verdict("4 breaker probes", True, "")
    times: dict[str, list[float]] = defaultdict(list)
    handbacks: dict[str, list[float]] = defaultdict(list)
    ends = call_ends or {}
    for a in arrivals:
        times[a["source"]].append(a["t"])
        end = ends.get(a["tag"]) if a.get("tag") else None
        if end is not None and a["t"] < end < a["t"] + verdict_after_s:
            handbacks[a["source"]].append(end)
    for s in sources:
        if s["fault"] not in ("dead", "black_hole"):
            continue
        ts = times.get(s["fake"], [])
        # A dead source answers at once, with its verdict: a call ending soon after is no
        # hand-back.
        back = handbacks.get(s["fake"], []) if s["fault"] == "black_hole" else []
        burst, close, opened = probe_spacing(ts, cooldown_s, resets, back)
        v.numbers[s["fake"]] = (
            f"{len(ts)} arrivals, opening burst {burst}, probes {len(ts) - burst}"
        )
        if close:
            v.ok = False
            for first, second in close[:5]:
                v.add(f"{s['fake']}: arrivals {second - first:.2f}s apart < cooldown {cooldown_s}s")
        if burst > burst_bound * (1 + len(resets)):
            v.ok = False
            v.add(f"{s['fake']}: {burst} arrivals before the breaker opened > {burst_bound}")
        # Never opened: traffic kept flowing to the source, no pause of a cooldown anywhere
        # (a pause cut short by a Redis restart counts) up to the end of the run.
        quiet = any(
            b - a >= cooldown_s * SPACING_TOLERANCE for a, b in itertools.pairwise(sorted(ts))
        )
        quiet = quiet or (bool(ts) and run_end - max(ts) >= cooldown_s * SPACING_TOLERANCE)
        if ts and not (opened or quiet) and ts[-1] - ts[0] > cooldown_s:
            v.ok = False
            v.add(f"{s['fake']}: never opened")
    v.summary = "; ".join(f"{k}: {val}" for k, val in v.numbers.items())
    return v


def check_outcomes(
    calls: Sequence[Mapping[str, Any]], deadline_s: float, *, excluded_workers: Iterable[str] = ()
) -> Verdict:
    """5. Every call ended in success or one of the library's classified errors; none ran
    past its total deadline."""
    v = Verdict("5 outcomes", True, "")
    excluded = set(excluded_workers)
    outcomes: Counter[str] = Counter()
    longest = 0.0
    for c in calls:
        if worker_of(c["tag"]) in excluded:
            continue
        outcomes["ok" if c["outcome"] == "ok" else f"{c['error']}"] += 1
        longest = max(longest, c["dur"])
        if c["outcome"] != "ok" and not c.get("classified"):
            v.ok = False
            v.add(f"unclassified {c['error']}: {c.get('detail', '')} (tag {c['tag']})")
        if c.get("hang") or c["dur"] > deadline_s + DEADLINE_SLACK_S:
            v.ok = False
            v.add(f"{c['tag']} ran {c['dur']:.1f}s > deadline {deadline_s}s")
    v.numbers = {
        "calls": sum(outcomes.values()),
        **dict(outcomes.most_common()),
        "longest s": round(longest, 2),
    }
    v.summary = (
        ", ".join(f"{k} {n}" for k, n in outcomes.most_common()) + f"; longest {longest:.1f}s"
    )
    return v


def check_cache(
    calls: Sequence[Mapping[str, Any]],
    rows: Sequence[Mapping[str, Any]],
    prices: Mapping[str, Any],
    resets: Sequence[tuple[float, float]] = (),
    *,
    expect_repeats: bool = True,
) -> Verdict:
    """6. Repeated requests hit (every repeat that started a second after a stored answer of
    its tenant, with no governance reset between, is a hit), a tenant only hits what it
    stored itself, and every row's cost is the pricing table's. ``expect_repeats=False``
    (scenarios without a repeated share, runs without a cache) checks the cost only."""
    v = Verdict("6 cache and cost", True, "")
    repeats = [c for c in calls if c.get("tenant") and c["outcome"] == "ok"]
    misses: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    for c in repeats:
        if not c.get("cache_hit"):
            misses[(c["tenant"], c["tag"])].append((c["t"], c["t"] + c["dur"]))
    hits = missed = foreign = 0
    for c in sorted(repeats, key=lambda c: c["t"]):
        key = (c["tenant"], c["tag"])
        end = c["t"] + c["dur"]
        if c.get("cache_hit"):
            hits += 1
            # The answer must have been fetched by this tenant, in a call begun before.
            if not any(start <= end for start, _ in misses[key]):
                foreign += 1
                v.add(f"tenant {c['tenant']} hit {c['tag']} it never stored")
            continue
        stored = [
            e
            for s_, e in misses[key]
            if e + 1.0 <= c["t"] and not any(e <= b and a <= c["t"] for a, b in resets)
        ]
        if stored:
            missed += 1
            v.add(f"tenant {c['tenant']} missed {c['tag']} stored at {min(stored):.1f}")
    should = hits + missed
    bad_cost = 0
    expected_total = recorded_total = 0.0
    for r in rows:
        price = prices.get(r["model"])
        if r["cache_hit"]:
            expected = 0.0
        elif not isinstance(price, Mapping):
            continue
        else:
            expected = (
                r["prompt_tokens"] * price["input_per_1m"]
                + r["completion_tokens"] * price["output_per_1m"]
            ) / 1e6
        cost = r["cost"]
        expected_total += expected
        recorded_total += cost or 0.0
        if cost is None or abs(cost - expected) > COST_TOLERANCE + 1e-9 * expected:
            bad_cost += 1
            v.add(
                f"cost {cost} != {expected} "
                f"({r['model']}, {r['prompt_tokens']}+{r['completion_tokens']})"
            )
    if not repeats and expect_repeats:
        v.add("no repeated calls")
    v.ok = (bool(hits) or not expect_repeats) and not missed and not foreign and not bad_cost
    v.numbers = {
        "repeated calls ok": len(repeats),
        "hits": hits,
        "should have hit": should,
        "missed": missed,
        "foreign hits": foreign,
        "rows with wrong cost": bad_cost,
        "cost recorded": round(recorded_total, 9),
        "cost from the price table": round(expected_total, 9),
    }
    v.summary = (
        f"{hits} hits of {should} expected, {missed} missed, {foreign} across tenants; "
        f"cost {recorded_total:.6f} = table {expected_total:.6f} ({bad_cost} rows off)"
    )
    return v


def check_drills(
    timeline: Sequence[Mapping[str, Any]],
    calls: Sequence[Mapping[str, Any]],
    killed: Iterable[str],
    dropped: int,
    deadline_s: float,
) -> Verdict:
    """The fault drills did what they should: after ``kill -9`` the other workers kept
    finishing calls (the victim's leases expiring is invariant 3); during a Redis restart
    calls failed closed (``GovernanceBackendError``) and succeeded again after it; during a
    telemetry outage calls went on as before and the recorders counted the rows they
    dropped."""
    v = Verdict("drills", True, "")
    events = {e["event"]: e for e in timeline}
    killed = set(killed)
    if "drill kill -9" in events:
        at = events["drill kill -9"]["t"]
        after = sum(
            1
            for c in calls
            if c["outcome"] == "ok" and c["t"] >= at and worker_of(c["tag"]) not in killed
        )
        v.numbers["kill: ok calls by the others after it"] = after
        v.numbers["kill: live leases just before / after"] = (
            f"{events['drill kill -9'].get('live_leases_before')} / "
            f"{events['drill kill -9'].get('live_leases_after')}"
        )
        if not after:
            v.ok = False
            v.add("no worker finished a call after the kill")
    if "drill redis down" in events and "drill redis up" in events:
        down, up = events["drill redis down"]["t"], events["drill redis up"]["t"]
        gap = [c for c in calls if down <= c["t"] < up]
        closed = sum(1 for c in gap if c.get("error") == "GovernanceBackendError")
        other = sum(
            1 for c in gap if c["outcome"] != "ok" and c.get("error") != "GovernanceBackendError"
        )
        recovered = sum(1 for c in calls if c["outcome"] == "ok" and c["t"] >= up + 2.0)
        v.numbers["redis: calls begun in the gap failing closed"] = f"{closed} of {len(gap)}"
        v.numbers["redis: other errors begun in the gap"] = other
        v.numbers["redis: ok calls begun 2 s after it"] = recovered
        if not closed or not recovered:
            v.ok = False
            v.add(f"redis restart: {closed} failed closed, {recovered} succeeded after")
    if "drill postgres down" in events and "drill postgres up" in events:
        down, up = events["drill postgres down"]["t"], events["drill postgres up"]["t"]

        gap = [c for c in calls if down <= c["t"] < up]
        rest = [c for c in calls if not down <= c["t"] < up]
        gap_errors = Counter(c.get("error") for c in gap if c["outcome"] != "ok")
        rest_errors = {c.get("error") for c in rest if c["outcome"] != "ok"}
        new_errors = sorted(str(e) for e in set(gap_errors) - rest_errors)
        ok_in_gap = sum(c["outcome"] == "ok" for c in gap)
        v.numbers["postgres: calls begun in the gap ok / all"] = f"{ok_in_gap} / {len(gap)}"
        v.numbers["postgres: errors in the gap"] = dict(gap_errors)
        v.numbers["postgres: longest call begun in the gap s"] = round(
            max((c["dur"] for c in gap), default=0.0), 2
        )
        v.numbers["postgres: rows dropped (recorders)"] = dropped
        # The ok share of a window depends on the quota (a saturated RPM gate fails calls by
        # their deadline whatever the telemetry does); what the outage must not do is add a
        # kind of failure, stretch a call past its deadline, or lose rows uncounted.
        if not gap or not ok_in_gap or new_errors or not dropped:
            v.ok = False
            v.add(
                f"telemetry outage: {ok_in_gap} ok of {len(gap)}, new errors {new_errors}, "
                f"{dropped} drops counted"
            )
        if any(c["dur"] > deadline_s + DEADLINE_SLACK_S for c in gap):
            v.ok = False
            v.add("a call begun during the telemetry outage ran past its deadline")
    if not v.numbers:
        v.summary = "no drill"
    else:
        v.summary = "; ".join(f"{k} {val}" for k, val in v.numbers.items())
    return v
