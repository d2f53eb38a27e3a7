"""Telemetry report: aggregate rows of ``pgw_calls`` into tables and a self-contained HTML page.

Pure functions over ``TelemetryRow`` mappings so the same report serves SQLite and any other
recorder that can hand back rows. Charts are inline SVG: the HTML file needs nothing else.
"""

from __future__ import annotations

import html
import math
import re
import sqlite3
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from datetime import UTC
from typing import Any, Literal

GroupBy = Literal["model", "source", "session", "scope", "namespace"]
_GROUP_COLUMN: dict[str, str] = {
    "model": "model",
    "source": "source_name",
    "session": "session_id",
    "scope": "scope",
    "namespace": "cache_namespace",
}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_since(value: str | None, *, now: float | None = None) -> float | None:
    """``"30m"``, ``"2h"``, ``"7d"`` (ago) or an ISO date/datetime -> epoch seconds."""
    if not value:
        return None
    now = time.time() if now is None else now
    match = _DURATION.match(value)
    if match:
        return now - float(match.group(1)) * _UNIT_S[match.group(2)]
    from datetime import datetime

    try:
        parsed = datetime.fromisoformat(value)
    except ValueError as exc:
        raise ValueError(
            f"--since {value!r}: expected a duration like 30m, 2h, 7d or an ISO date"
        ) from exc
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return parsed.timestamp()


def read_sqlite_rows(path: str, *, since: float | None = None) -> list[dict[str, Any]]:
    """All rows of ``pgw_calls`` (optionally newer than ``since``), oldest first."""
    uri = f"file:{path}?mode=ro"
    with closing(sqlite3.connect(uri, uri=True)) as conn:
        conn.row_factory = sqlite3.Row
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if "pgw_calls" not in tables:
            raise ValueError(f"{path}: no pgw_calls table (is this a PolyGateway telemetry db?)")
        sql = "SELECT * FROM pgw_calls"
        params: tuple[Any, ...] = ()
        if since is not None:
            sql += " WHERE created_at >= ?"
            params = (since,)
        sql += " ORDER BY created_at"
        return [dict(r) for r in conn.execute(sql, params)]


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


@dataclass
class GroupStats:
    key: str
    calls: int = 0
    errors: int = 0
    cache_hits: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost: float = 0.0
    priced: int = 0
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)

    def as_row(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "calls": self.calls,
            "errors": self.errors,
            "cache_hits": self.cache_hits,
            "p50_ms": percentile(self.latencies, 50),
            "p95_ms": percentile(self.latencies, 95),
            "ttft_p50_ms": percentile(self.ttfts, 50),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cost": round(self.cost, 6) if self.priced else None,
        }


@dataclass
class Report:
    total: GroupStats
    groups: list[GroupStats]
    errors_by_class: Counter[str]
    errors_by_source: dict[str, Counter[str]]
    by: GroupBy
    rows: list[Mapping[str, Any]]


def build_report(rows: Iterable[Mapping[str, Any]], *, by: GroupBy = "model") -> Report:
    column = _GROUP_COLUMN[by]
    total = GroupStats("total")
    groups: dict[str, GroupStats] = {}
    errors_by_class: Counter[str] = Counter()
    errors_by_source: dict[str, Counter[str]] = defaultdict(Counter)
    kept: list[Mapping[str, Any]] = []
    for row in rows:
        kept.append(row)
        key = str(row.get(column) or "-")
        group = groups.setdefault(key, GroupStats(key))
        for stats in (total, group):
            stats.calls += 1
            error = row.get("error")
            if error:
                stats.errors += 1
            if row.get("cache_hit"):
                stats.cache_hits += 1
            stats.prompt_tokens += int(row.get("prompt_tokens") or 0)
            stats.completion_tokens += int(row.get("completion_tokens") or 0)
            if row.get("cost") is not None:
                stats.cost += float(row["cost"])
                stats.priced += 1
            if not error and not row.get("cache_hit"):
                stats.latencies.append(float(row.get("latency_ms") or 0))
                if row.get("ttft_ms") is not None:
                    stats.ttfts.append(float(row["ttft_ms"]))
        if row.get("error"):
            errors_by_class[str(row["error"])] += 1
            errors_by_source[str(row.get("source_name") or "-")][str(row["error"])] += 1
    ordered = sorted(groups.values(), key=lambda g: (-g.calls, g.key))
    return Report(total, ordered, errors_by_class, dict(errors_by_source), by, kept)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4f}" if value < 10 else f"{value:.0f}"
    return str(value)


_COLUMNS = (
    ("key", "group"),
    ("calls", "calls"),
    ("errors", "errors"),
    ("cache_hits", "cache hits"),
    ("p50_ms", "p50 ms"),
    ("p95_ms", "p95 ms"),
    ("ttft_p50_ms", "TTFT p50 ms"),
    ("prompt_tokens", "prompt tok"),
    ("completion_tokens", "compl tok"),
    ("cost", "cost"),
)


def render_text(report: Report) -> str:
    """Plain-text tables for the terminal."""
    table = [[label for _, label in _COLUMNS]]
    for stats in [*report.groups, report.total]:
        row = stats.as_row()
        table.append([_fmt(row[k]) for k, _ in _COLUMNS])
    table[0][0] = report.by
    widths = [max(len(r[i]) for r in table) for i in range(len(_COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.insert(len(lines) - 1, "  ".join("-" * w for w in widths))
    out = [f"Calls by {report.by}", *lines, ""]
    out.append("Errors by class")
    if report.errors_by_class:
        for name, count in report.errors_by_class.most_common():
            out.append(f"  {name:32} {count}")
    else:
        out.append("  (none)")
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------ HTML


def _svg_bars(items: Sequence[tuple[str, float]], *, title: str, unit: str = "") -> str:
    if not items:
        return f"<h3>{html.escape(title)}</h3><p>(no data)</p>"
    width, bar_h, label_w = 640, 18, 170
    peak = max(v for _, v in items) or 1.0
    parts = [f'<svg width="{width}" height="{len(items) * (bar_h + 4) + 8}" role="img">']
    for i, (label, value) in enumerate(items):
        y = 4 + i * (bar_h + 4)
        w = (width - label_w - 80) * value / peak
        parts.append(
            f'<text x="0" y="{y + 13}" font-size="12">{html.escape(label[:26])}</text>'
            f'<rect x="{label_w}" y="{y}" width="{w:.1f}" height="{bar_h}" fill="#4a78c2"/>'
            f'<text x="{label_w + w + 4:.1f}" y="{y + 13}" font-size="12">'
            f"{_fmt(value)}{unit}</text>"
        )
    parts.append("</svg>")
    return f"<h3>{html.escape(title)}</h3>" + "".join(parts)


def latency_histogram(latencies: Sequence[float], buckets: int = 12) -> list[tuple[str, float]]:
    if not latencies:
        return []
    low, high = min(latencies), max(latencies)
    if high <= low:
        return [(f"{low:.0f} ms", float(len(latencies)))]
    step = (high - low) / buckets
    counts = [0] * buckets
    for value in latencies:
        counts[min(buckets - 1, int((value - low) / step))] += 1
    return [
        (f"{low + i * step:.0f}-{low + (i + 1) * step:.0f} ms", float(c))
        for i, c in enumerate(counts)
    ]


def cost_over_time(rows: Sequence[Mapping[str, Any]], buckets: int = 12) -> list[tuple[str, float]]:
    stamped = [(float(r.get("created_at") or 0), float(r.get("cost") or 0)) for r in rows]
    if not stamped:
        return []
    start, end = stamped[0][0], stamped[-1][0]
    span = max(end - start, 1e-9)
    totals = [0.0] * buckets
    for ts, cost in stamped:
        totals[min(buckets - 1, int((ts - start) / span * buckets))] += cost
    labels = [
        time.strftime("%m-%d %H:%M:%S", time.localtime(start + i * span / buckets))
        for i in range(buckets)
    ]
    return list(zip(labels, totals, strict=True))


def render_html(report: Report, *, title: str = "PolyGateway telemetry") -> str:
    head = "".join(f"<th>{html.escape(label)}</th>" for _, label in _COLUMNS)
    body_rows = []
    for stats in [*report.groups, report.total]:
        row = stats.as_row()
        cells = "".join(f"<td>{html.escape(_fmt(row[k]))}</td>" for k, _ in _COLUMNS)
        body_rows.append(f"<tr>{cells}</tr>")
    by_source = sorted(
        ((src, float(sum(c.values()))) for src, c in report.errors_by_source.items()),
        key=lambda kv: -kv[1],
    )
    errors = [(name, float(n)) for name, n in report.errors_by_class.most_common()]
    sections = [
        _svg_bars(latency_histogram(report.total.latencies), title="Latency distribution"),
        _svg_bars(cost_over_time(report.rows), title="Cost over time"),
        _svg_bars(by_source, title="Errors by source"),
        _svg_bars(errors, title="Errors by class"),
    ]
    style = (
        "body{font-family:system-ui,sans-serif;margin:2em;color:#222}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 8px;"
        "text-align:right}td:first-child,th:first-child{text-align:left}"
    )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{style}</style></head><body><h1>{html.escape(title)}</h1>"
        f"<p>{report.total.calls} rows, grouped by {report.by}.</p>"
        f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body_rows)}</tbody></table>"
        + "".join(sections)
        + "</body></html>"
    )
