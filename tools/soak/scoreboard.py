"""The scoreboard of one soak run: reads the run's telemetry (SQLite files or PostgreSQL), the
fake upstreams' own counters and arrival log, the Redis snapshot and the workers' call logs,
asserts the six hard invariants (``invariants.py``) and writes
``tests/outputs/soak/<run_id>.md`` plus ``<run_id>.html`` (charts).

    python tools/soak/scoreboard.py tests/outputs/soak/<run_id>/

Exit status 0 when every invariant holds, 1 otherwise (run_soak.py calls it at the end).
"""

from __future__ import annotations

import glob
import html
import json
import os
import sqlite3
import sys
from collections import Counter, defaultdict
from collections.abc import Sequence
from contextlib import closing
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import invariants  # noqa: E402

E2E = "e2e ms p50/p99 (healthy, non-cached chat)"
ADDED = "added ms p50/p99 (call - transport)"
COLUMNS = (
    "scope, source_name, messages, cache_hit, error, prompt_tokens, completion_tokens, cost, "
    "model, cache_namespace, session_id, created_at, latency_ms"
)


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """The complete JSON lines of ``path`` (a killed writer's last, cut line is skipped)."""
    out: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def _row(values: Sequence[Any]) -> dict[str, Any]:
    names = [c.strip() for c in COLUMNS.split(",")]
    row = dict(zip(names, values, strict=True))
    row["cache_hit"] = bool(row["cache_hit"])
    return row


def rows_sqlite(run_dir: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for spec_path in sorted(glob.glob(os.path.join(run_dir, "spec-*.json"))):
        with open(spec_path, encoding="utf-8") as f:
            path = json.load(f).get("telemetry_path")
        if not path or not os.path.exists(path):
            continue
        with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
            rows.extend(_row(r) for r in conn.execute(f"SELECT {COLUMNS} FROM pgw_calls"))
    return rows


def rows_postgres(dsn: str, run_id: str) -> list[dict[str, Any]]:
    import asyncio

    import asyncpg

    async def fetch() -> list[dict[str, Any]]:
        conn = await asyncpg.connect(dsn)
        try:
            records = await conn.fetch(
                f"SELECT {COLUMNS} FROM pgw_calls WHERE session_id LIKE $1", f"{run_id}:%"
            )
        finally:
            await conn.close()
        return [_row(tuple(r)) for r in records]

    return asyncio.run(fetch())


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def resets_of(run: dict[str, Any]) -> list[tuple[float, float]]:
    """Spans where governance state was cleared (Redis restart), widened by the slowest
    attempt (calls admitted before it still run) and a minute window."""
    down = [e["t"] for e in run["timeline"] if e["event"] == "drill redis down"]
    up = [e["t"] for e in run["timeline"] if e["event"] == "drill redis up"]
    return [(a, b + run["limits"]["timeout_s"] + 1.0) for a, b in zip(down, up, strict=False)]


def measure(
    run: dict[str, Any], summaries: list[dict[str, Any]], calls: list[dict[str, Any]]
) -> dict[str, Any]:
    # From the first call's start to the last call's end (the workers' start-up excluded).
    first = min((c["t"] for c in calls), default=run["started"])
    last = max((c["t"] + c["dur"] for c in calls), default=run["ended"])
    wall = max(1e-9, last - first)
    per_worker = {
        s["worker"]: {
            "calls": s["calls"],
            "calls/s": round(s["calls"] / max(s["elapsed_s"], 1e-9), 1),
            "CPU ms/call": round(1000 * s["cpu_s"] / max(s["calls"], 1), 2),
        }
        for s in summaries
    }
    healthy = {"openai-1", "openai-2"}
    ok_chat = [
        c
        for c in calls
        if c["outcome"] == "ok"
        and c["kind"] == "chat"
        and not c.get("cache_hit")
        and c.get("source") in healthy
        and c.get("latency_ms") is not None
    ]
    e2e = [1000 * c["dur"] for c in ok_chat]
    added = [max(0.0, 1000 * c["dur"] - c["latency_ms"]) for c in ok_chat]
    rss: dict[str, Any] = {}
    warm = 0.2 * (run["ended"] - run["started"])
    for s in summaries:
        samples = [kib for t, kib in s["rss_kib"] if t >= warm]
        if len(samples) >= 2:
            base = min(samples)
            rss[s["worker"]] = {
                "after warm-up MiB": round(base / 1024, 1),
                "end MiB": round(samples[-1] / 1024, 1),
                "growth %": round(100 * (max(samples) - base) / base, 1),
            }
    total_calls = sum(s["calls"] for s in summaries)
    trips = run.get("redis_round_trips")
    return {
        "wall s": round(wall, 1),
        "calls": total_calls,
        "calls/s total": round(len(calls) / wall, 1),
        "per worker": per_worker,
        E2E: f"{percentile(e2e, 50):.1f} / {percentile(e2e, 99):.1f} (n={len(e2e)})",
        ADDED: f"{percentile(added, 50):.1f} / {percentile(added, 99):.1f}",
        "CPU ms/call (all workers)": round(
            1000 * sum(s["cpu_s"] for s in summaries) / max(total_calls, 1), 2
        ),
        "rss": rss,
        "redis round trips/call": round(trips / max(total_calls, 1), 2) if trips else None,
        "load average at end": run.get("load_average"),
    }


def score(run_dir: str) -> tuple[dict[str, Any], list[invariants.Verdict], dict[str, Any]]:
    with open(os.path.join(run_dir, "run.json"), encoding="utf-8") as f:
        run = json.load(f)
    with open(os.path.join(run_dir, "redis-snapshot.json"), encoding="utf-8") as f:
        snapshot = json.load(f)
    arrivals = read_jsonl(os.path.join(run_dir, "arrivals.jsonl"))
    calls = [
        c for p in sorted(glob.glob(os.path.join(run_dir, "calls-*.jsonl"))) for c in read_jsonl(p)
    ]
    summaries = []
    for p in sorted(glob.glob(os.path.join(run_dir, "worker-*.json"))):
        with open(p, encoding="utf-8") as f:
            summaries.append(json.load(f))
    ocr_path = os.path.join(run_dir, "ocr-counters.json")
    ocr: dict[str, Any] = {}
    if os.path.exists(ocr_path):
        with open(ocr_path, encoding="utf-8") as f:
            ocr = json.load(f)
    dsn_path = os.path.join(run_dir, "dsn.txt")
    if os.path.exists(dsn_path):
        with open(dsn_path, encoding="utf-8") as f:
            rows = rows_postgres(f.read().strip(), run["run_id"])
    else:
        rows = rows_sqlite(run_dir)
    killed = run["killed"]
    resets = resets_of(run)
    dropped = sum(s.get("telemetry_dropped") or 0 for s in summaries)
    limits = run["limits"]
    missing_summaries = (
        {f"w{i}" for i in range(run["workers"])} - {s["worker"] for s in summaries} - set(killed)
    )
    verdicts = [
        invariants.check_limits(
            arrivals,
            run["sources"],
            run["counters"],
            ocr,
            limits["global_concurrency"],
            limits["global_rpm"],
            resets,
        ),
        invariants.check_rows(
            arrivals, rows, run["sources"], ocr, excluded_workers=killed, dropped=dropped
        ),
        invariants.check_redis(snapshot),
        invariants.check_breakers(
            arrivals,
            run["sources"],
            limits["cooldown_s"],
            run["ended"],
            run["workers"] * run["concurrency"] + 2 * limits["fail_threshold"],
            resets,
            {c["tag"]: c["t"] + c["dur"] for c in calls if "dur" in c},
            limits.get("ttft_timeout_s", 0.0),
        ),
        invariants.check_outcomes(calls, limits["call_deadline_s"], excluded_workers=killed),
        invariants.check_cache(
            calls,
            rows,
            run["prices"],
            resets,
            expect_repeats=run["scenario"] in ("P3", "P4", "P6") and run["cache"],
        ),
    ]
    if run["drills"]:
        verdicts.append(
            invariants.check_drills(
                run["timeline"], calls, killed, dropped, limits["call_deadline_s"]
            )
        )
    if missing_summaries:
        verdicts[4].ok = False
        verdicts[4].add(
            f"workers without a summary (did not stop cleanly): {sorted(missing_summaries)}"
        )
    if run.get("healthy_only"):
        verdicts[3].summary += " (healthy-only run: no faulty source)"
    metrics = measure(run, summaries, calls)
    metrics["arrivals by source"] = dict(Counter(a["source"] for a in arrivals).most_common())
    return run, verdicts, metrics


def write_markdown(
    path: str, run: dict[str, Any], verdicts: list[invariants.Verdict], metrics: dict[str, Any]
) -> None:
    ok = all(v.ok for v in verdicts)
    lines = [
        f"# Soak run {run['run_id']}: {'all invariants hold' if ok else 'INVARIANT BROKEN'}",
        "",
        f"Scenario {run['scenario']}, {run['workers']} workers x {run['concurrency']} calls in "
        "flight, "
        f"stopped: {run['stop_reason']}; drills: {', '.join(run['drills']) or 'none'}; "
        f"telemetry {run['telemetry']['kind']}; global RPM {run['limits']['global_rpm']}; "
        f"load average at the end {', '.join(f'{x:.1f}' for x in run['load_average'])}.",
        "",
        "| invariant | verdict | summary |",
        "|---|---|---|",
    ]
    for v in verdicts:
        lines.append(f"| {v.name} | {'ok' if v.ok else 'BROKEN'} | {v.summary} |")
    lines.append("")
    for v in verdicts:
        lines.append(f"## {v.name}: {'ok' if v.ok else 'BROKEN'}")
        lines.append("")
        for k, val in v.numbers.items():
            lines.append(f"- {k}: {val}")
        for d in v.details:
            lines.append(f"- detail: {d}")
        lines.append("")
    lines.append("## Measurements")
    lines.append("")
    for k, val in metrics.items():
        lines.append(f"- {k}: {json.dumps(val) if isinstance(val, dict | list) else val}")
    lines.append("")
    lines.append("## Timeline")
    lines.append("")
    for e in run["timeline"]:
        rest = {k: v for k, v in e.items() if k not in ("t", "event")}
        lines.append(
            f"- +{e['t'] - run['started']:.1f}s {e['event']} {json.dumps(rest) if rest else ''}"
        )
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def _svg(title: str, series: dict[str, list[tuple[float, float]]], y_label: str) -> str:
    width, height, pad = 720, 240, 40
    points = [p for s in series.values() for p in s]
    if not points:
        return f"<h3>{html.escape(title)}</h3><p>no data</p>"
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    y1 = max(p[1] for p in points) or 1.0
    colours = [
        "#1f77b4",
        "#d62728",
        "#2ca02c",
        "#ff7f0e",
        "#9467bd",
        "#8c564b",
        "#e377c2",
        "#7f7f7f",
        "#bcbd22",
        "#17becf",
    ]
    out = [
        f"<h3>{html.escape(title)}</h3>"
        f"<svg width='{width}' height='{height}' style='background:#fafafa'>"
    ]
    for i, (name, pts) in enumerate(sorted(series.items())):
        coords = " ".join(
            f"{pad + (x - x0) / max(x1 - x0, 1e-9) * (width - 2 * pad):.1f},"
            f"{height - pad - y / y1 * (height - 2 * pad):.1f}"
            for x, y in pts
        )
        colour = colours[i % len(colours)]
        out.append(
            f"<polyline fill='none' stroke='{colour}' stroke-width='1.5' points='{coords}'/>"
        )
        out.append(
            f"<text x='{width - 150}' y='{16 + 14 * i}' fill='{colour}' font-size='11'>"
            f"{html.escape(name)}</text>"
        )
    out.append(f"<text x='4' y='14' font-size='11'>{html.escape(y_label)} (max {y1:g})</text>")
    out.append(f"<text x='{pad}' y='{height - 8}' font-size='11'>0 s</text>")
    out.append(
        f"<text x='{width - pad - 30}' y='{height - 8}' font-size='11'>{x1 - x0:.0f} s</text></svg>"
    )
    return "\n".join(out)


def write_html(
    path: str, run_dir: str, run: dict[str, Any], verdicts: list[invariants.Verdict]
) -> None:
    t0 = run["started"]
    calls = [
        c for p in sorted(glob.glob(os.path.join(run_dir, "calls-*.jsonl"))) for c in read_jsonl(p)
    ]
    buckets: dict[str, Counter[int]] = defaultdict(Counter)
    for c in calls:
        buckets["ok" if c["outcome"] == "ok" else "error"][int((c["t"] + c["dur"] - t0) // 10)] += 1
    per_outcome = {
        k: [(10.0 * b, n / 10) for b, n in sorted(v.items())] for k, v in buckets.items()
    }
    arrivals = read_jsonl(os.path.join(run_dir, "arrivals.jsonl"))
    by_source: dict[str, Counter[int]] = defaultdict(Counter)
    for a in arrivals:
        by_source[a["source"]][int((a["t"] - t0) // 10)] += 1
    per_source = {
        k: [(10.0 * b, n / 10) for b, n in sorted(v.items())] for k, v in by_source.items()
    }
    rss: dict[str, list[tuple[float, float]]] = {}
    for p in sorted(glob.glob(os.path.join(run_dir, "worker-*.json"))):
        with open(p, encoding="utf-8") as f:
            s = json.load(f)
        rss[s["worker"]] = [(t, kib / 1024) for t, kib in s["rss_kib"]]
    rows = "".join(
        f"<tr><td>{html.escape(v.name)}</td><td style='color:{'green' if v.ok else 'red'}'>"
        f"{'ok' if v.ok else 'BROKEN'}</td><td>{html.escape(v.summary)}</td></tr>"
        for v in verdicts
    )
    page = (
        f"<!doctype html><meta charset='utf-8'><title>soak {html.escape(run['run_id'])}</title>"
        f"<body style='font-family:sans-serif'><h1>Soak run {html.escape(run['run_id'])}</h1>"
        f"<table border='1' cellpadding='4' style='border-collapse:collapse'>{rows}</table>"
        + _svg("Calls finished per second (10 s buckets)", per_outcome, "calls/s")
        + _svg(
            "Requests reaching each upstream source per second (10 s buckets)", per_source, "req/s"
        )
        + _svg("RSS per worker", rss, "MiB")
        + "</body>"
    )
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: scoreboard.py RUN_DIR", file=sys.stderr)
        return 2
    run_dir = os.path.abspath(args[0].rstrip("/"))
    run, verdicts, metrics = score(run_dir)
    base = os.path.join(os.path.dirname(run_dir), run["run_id"])
    write_markdown(base + ".md", run, verdicts, metrics)
    write_html(base + ".html", run_dir, run, verdicts)
    for v in verdicts:
        print(f"scoreboard: {v.name}: {'ok' if v.ok else 'BROKEN'}: {v.summary}")
        for d in v.details[:5] if not v.ok else ():
            print(f"    {d}")
    print(f"scoreboard: calls/s total {metrics['calls/s total']}; e2e ms p50/p99 {metrics[E2E]}")
    print(f"scoreboard: report {base}.md (+ .html)")
    return 0 if all(v.ok for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
