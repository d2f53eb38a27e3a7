"""Telemetry report: aggregate rows of ``pgw_calls`` into tables and a self-contained HTML page.

Pure functions over row mappings so the same report serves SQLite and any other recorder that
can hand back rows. Charts are inline SVG: the HTML file needs nothing else.

What the rows can tell (one row per attempt, per cache hit, per call refused before any
attempt; ARCHITECTURE §7.8), counted apart and never mixed:

- calls: the rows of one call share its ``root_call_id`` (a row without one, written before
  the column existed, is a call of its own). A call is answered when one of its rows succeeded
  (an attempt or a cache hit), failed when every row has an error (every attempt failed, or it
  was refused or cancelled before any attempt). A call is counted in the group of the row that
  answered it, else of its last row;
- attempts: rows that reached a source (``source_name`` set, not a cache hit), ok or failed;
- cache hits; refused calls (rows without a source: refused before any attempt);
- failed attempts by error class.
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
from datetime import UTC, datetime
from typing import Any, Literal

from polygateway.frozen import value_methods

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


def is_attempt(row: Mapping[str, Any]) -> bool:
    """A row of an attempt that reached a source (not a cache hit, not a refused call)."""
    return not row.get("cache_hit") and bool(row.get("source_name"))


def call_of(row: Mapping[str, Any]) -> str:
    """The call a row belongs to: its ``root_call_id``, else (older rows) its own id."""
    return str(row.get("root_call_id") or row.get("call_id") or "")


@value_methods
@dataclass(repr=False, eq=False)
class GroupStats:
    key: str
    rows: int = 0
    calls: int = 0
    """Calls (each counted once, however many attempts it made)."""
    answered: int = 0
    """Calls answered by a source or from the cache."""
    failed_calls: int = 0
    """Calls without an answer: every attempt failed, or refused or cancelled before one."""
    retries: int = 0
    """Attempts after a call's first (retries, switches to another source, re-asks)."""
    attempts: int = 0
    ok: int = 0
    """Successful attempts."""
    failed_attempts: int = 0
    cache_hits: int = 0
    refused: int = 0
    """Calls refused before any attempt (no source)."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost: float = 0.0
    priced: int = 0
    unpriced: int = 0
    """Successful attempts without a price (cost unknown: not counted as zero)."""
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)

    @property
    def errors(self) -> int:
        """Rows with an error: failed attempts plus refused calls."""
        return self.failed_attempts + self.refused

    def add(self, row: Mapping[str, Any]) -> None:
        self.rows += 1
        error = row.get("error")
        if row.get("cache_hit"):
            self.cache_hits += 1
        elif not row.get("source_name"):
            self.refused += 1
        else:
            self.attempts += 1
            if error:
                self.failed_attempts += 1
            else:
                self.ok += 1
                self.latencies.append(float(row.get("latency_ms") or 0))
                if row.get("ttft_ms") is not None:
                    self.ttfts.append(float(row["ttft_ms"]))
        self.prompt_tokens += int(row.get("prompt_tokens") or 0)
        self.completion_tokens += int(row.get("completion_tokens") or 0)
        if row.get("cost") is not None:
            self.cost += float(row["cost"])
            self.priced += 1
        elif not error and not row.get("cache_hit"):
            self.unpriced += 1

    def add_call(self, *, answered: bool, attempts: int) -> None:
        self.calls += 1
        if answered:
            self.answered += 1
        else:
            self.failed_calls += 1
        self.retries += max(0, attempts - 1)

    def as_row(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "calls": self.calls,
            "answered": self.answered,
            "failed_calls": self.failed_calls,
            "attempts": self.attempts,
            "failed_attempts": self.failed_attempts,
            "cache_hits": self.cache_hits,
            "refused": self.refused,
            "p50_ms": percentile(self.latencies, 50),
            "p95_ms": percentile(self.latencies, 95),
            "ttft_p50_ms": percentile(self.ttfts, 50),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cost": round(self.cost, 6) if self.priced else None,
            "unpriced": self.unpriced,
        }


@value_methods
@dataclass(repr=False, eq=False)
class Report:
    total: GroupStats
    groups: list[GroupStats]
    errors_by_class: Counter[str]
    errors_by_source: dict[str, Counter[str]]
    by: GroupBy
    rows: list[Mapping[str, Any]]
    currency: str = ""
    """The price table's currency label (``""``: not given)."""

    @property
    def first_at(self) -> float | None:
        return float(self.rows[0].get("created_at") or 0) if self.rows else None

    @property
    def last_at(self) -> float | None:
        return float(self.rows[-1].get("created_at") or 0) if self.rows else None


def build_report(
    rows: Iterable[Mapping[str, Any]], *, by: GroupBy = "model", currency: str = ""
) -> Report:
    column = _GROUP_COLUMN[by]
    total = GroupStats("total")
    groups: dict[str, GroupStats] = {}
    errors_by_class: Counter[str] = Counter()
    errors_by_source: dict[str, Counter[str]] = defaultdict(Counter)
    kept: list[Mapping[str, Any]] = []
    for row in rows:
        kept.append(row)
        key = str(row.get(column) or "-")
        total.add(row)
        groups.setdefault(key, GroupStats(key)).add(row)
        if row.get("error"):
            errors_by_class[str(row["error"])] += 1
            errors_by_source[str(row.get("source_name") or "-")][str(row["error"])] += 1
    kept.sort(key=lambda r: float(r.get("created_at") or 0))
    calls: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for row in kept:
        calls[call_of(row)].append(row)
    for members in calls.values():
        answer = next((r for r in members if not r.get("error")), None)
        # The group of the row that answered, else of the last attempt.
        key = str((answer or members[-1]).get(column) or "-")
        attempts = sum(1 for r in members if is_attempt(r))
        total.add_call(answered=answer is not None, attempts=attempts)
        groups.setdefault(key, GroupStats(key)).add_call(
            answered=answer is not None, attempts=attempts
        )
    ordered = sorted(groups.values(), key=lambda g: (-g.rows, g.key))
    return Report(total, ordered, errors_by_class, dict(errors_by_source), by, kept, currency)


# ------------------------------------------------------------------------------ formatting


def fmt_count(value: int | None) -> str:
    return "-" if value is None else f"{int(value):,}"


def fmt_ms(value: float | None) -> str:
    """A duration given in milliseconds, with its unit: ``85 ms``, ``1.24 s``, ``3 min``."""
    if value is None:
        return "-"
    if value < 1000:
        return f"{value:.0f} ms"
    if value < 60_000:
        return f"{value / 1000:.2f} s"
    return f"{value / 60_000:.1f} min"


def fmt_cost(value: float | None, currency: str) -> str:
    if value is None:
        return "-"
    text = f"{value:.6f}" if value < 1 else f"{value:,.2f}"
    return f"{text} {currency}" if currency else text


def fmt_time(epoch: float | None) -> str:
    if epoch is None:
        return "-"
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def summary_lines(report: Report) -> list[str]:
    """The totals, one fact per line: what ``pgw demo`` prints too, from the same rows."""
    t = report.total
    lines = [
        f"calls {fmt_count(t.calls)}: {fmt_count(t.answered)} answered, "
        f"{fmt_count(t.failed_calls)} failed",
        f"answered calls {fmt_count(t.answered)} ({fmt_count(t.answered - t.cache_hits)} by a "
        f"source, {fmt_count(t.cache_hits)} from the cache)",
        f"attempts {fmt_count(t.attempts)} ({fmt_count(t.ok)} ok, "
        f"{fmt_count(t.failed_attempts)} failed; {fmt_count(t.retries)} after a call's first)",
        f"cache hits {fmt_count(t.cache_hits)}",
        f"refused before any attempt {fmt_count(t.refused)}",
        f"tokens {fmt_count(t.prompt_tokens)} prompt + {fmt_count(t.completion_tokens)} completion",
    ]
    cost = fmt_cost(t.cost if t.priced else None, report.currency)
    noun = "attempt" if t.unpriced == 1 else "attempts"
    unpriced = f" ({fmt_count(t.unpriced)} {noun} without a price)" if t.unpriced else ""
    lines.append(f"cost {cost}{unpriced}")
    return lines


_COLUMNS: tuple[tuple[str, str], ...] = (
    ("key", "group"),
    ("calls", "calls"),
    ("failed_calls", "failed calls"),
    ("attempts", "attempts"),
    ("failed_attempts", "failed attempts"),
    ("cache_hits", "cache hits"),
    ("p50_ms", "latency p50"),
    ("p95_ms", "latency p95"),
    ("ttft_p50_ms", "TTFT p50"),
    ("prompt_tokens", "prompt tok"),
    ("completion_tokens", "compl tok"),
    ("cost", "cost"),
)


def _cell(name: str, value: Any, currency: str) -> str:
    if name == "key":
        return str(value)
    if name.endswith("_ms"):
        return fmt_ms(value)
    if name == "cost":
        return fmt_cost(value, currency)
    return fmt_count(value)


def _line(cells: Sequence[str], widths: Sequence[int]) -> str:
    # The group name left-aligned, numbers right-aligned.
    padded = [
        c.ljust(w) if i == 0 else c.rjust(w)
        for i, (c, w) in enumerate(zip(cells, widths, strict=True))
    ]
    return "  ".join(padded)


def render_text(report: Report, *, source: str = "") -> str:
    """Plain-text tables for the terminal."""
    table = [[label for _, label in _COLUMNS]]
    for stats in [*report.groups, report.total]:
        row = stats.as_row()
        table.append([_cell(k, row[k], report.currency) for k, _ in _COLUMNS])
    table[0][0] = report.by
    widths = [max(len(r[i]) for r in table) for i in range(len(_COLUMNS))]
    lines = [_line(r, widths) for r in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.insert(len(lines) - 1, "  ".join("-" * w for w in widths))
    out: list[str] = []
    if source:
        out.append(
            f"{source}: {fmt_count(len(report.rows))} rows, "
            f"{fmt_time(report.first_at)} to {fmt_time(report.last_at)}"
        )
        out.append("")
    out += [
        f"By {report.by} (a call in the group of the row that answered it, else of its last "
        "attempt; latency of successful attempts)",
        *lines,
        "",
    ]
    out += summary_lines(report)
    out += ["", "Errors by class"]
    if report.errors_by_class:
        width = max(len(name) for name in report.errors_by_class)
        for name, count in report.errors_by_class.most_common():
            out.append(f"  {name.ljust(width)}  {fmt_count(count)}")
    else:
        out.append("  (none)")
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------ charts

Bar = tuple[str, float | None]
"""A label and its value; ``None`` draws an explicit "no data" bar (never a zero)."""


def axis_ticks(peak: float, *, whole: bool) -> tuple[float, int]:
    """A round tick step (1, 2 or 5 times a power of ten; at least 1 for counts) and the number
    of steps (at most 5) that reach ``peak``."""
    if peak <= 0:
        return 1.0, 1
    rough = peak / 5
    power = 10.0 ** math.floor(math.log10(rough))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= rough)
    if whole:
        step = max(1.0, float(math.ceil(step)))
    return step, max(1, math.ceil(peak / step - 1e-9))


def _tick_text(value: float, step: float) -> str:
    """A tick label with as many decimals as the step needs (``0.00005``, ``250``)."""
    decimals = max(0, -math.floor(math.log10(step))) if step < 1 else 0
    return f"{value:,.{decimals}f}"


def _svg_bars(
    items: Sequence[Bar], *, title: str, value_label: str, category_label: str, fmt: Any = None
) -> str:
    """Horizontal bars with a value axis (round ticks, unit) and a category axis caption."""
    show = fmt or (lambda v: fmt_count(int(v)) if float(v).is_integer() else f"{v:g}")
    heading = f"<h3>{html.escape(title)}</h3>"
    if not items:
        return heading + "<p>(no data)</p>"
    width, bar_h, label_w, right = 720, 18, 190, 110
    plot_w = width - label_w - right
    whole = all(v is None or float(v).is_integer() for _, v in items)
    step, steps = axis_ticks(max((v for _, v in items if v is not None), default=0.0), whole=whole)
    peak = step * steps
    top = 8
    height = top + len(items) * (bar_h + 4) + 44
    parts = [
        f'<svg width="{width}" height="{height}" role="img" aria-label="{html.escape(title)}" '
        'font-family="system-ui,sans-serif">'
    ]
    for i, (label, value) in enumerate(items):
        y = top + i * (bar_h + 4)
        parts.append(
            f'<text x="{label_w - 6}" y="{y + 13}" font-size="12" text-anchor="end">'
            f"{html.escape(label[:30])}</text>"
        )
        if value is None:
            parts.append(
                f'<rect x="{label_w}" y="{y}" width="{plot_w}" height="{bar_h}" fill="none" '
                f'stroke="#bbb" stroke-dasharray="4 3"/><text x="{label_w + 6}" y="{y + 13}" '
                'font-size="12" fill="#888">no price</text>'
            )
            continue
        w = plot_w * value / peak
        parts.append(
            f'<rect x="{label_w}" y="{y}" width="{w:.1f}" height="{bar_h}" fill="#4a78c2"/>'
            f'<text x="{label_w + w + 4:.1f}" y="{y + 13}" font-size="12">'
            f"{html.escape(show(value))}</text>"
        )
    axis_y = top + len(items) * (bar_h + 4) + 2
    parts.append(
        f'<line x1="{label_w}" y1="{top - 4}" x2="{label_w}" y2="{axis_y}" stroke="#444"/>'
        f'<line x1="{label_w}" y1="{axis_y}" x2="{label_w + plot_w}" y2="{axis_y}" '
        'stroke="#444"/>'
    )
    for k in range(steps + 1):
        x = label_w + plot_w * k / steps
        parts.append(
            f'<line x1="{x:.1f}" y1="{axis_y}" x2="{x:.1f}" y2="{axis_y + 4}" stroke="#444"/>'
            f'<text x="{x:.1f}" y="{axis_y + 16}" font-size="11" text-anchor="middle">'
            f"{html.escape(_tick_text(step * k, step))}</text>"
        )
    parts.append(
        f'<text x="{label_w + plot_w / 2:.1f}" y="{axis_y + 34}" font-size="12" '
        f'text-anchor="middle">{html.escape(value_label)}</text>'
        f'<text x="4" y="{axis_y + 34}" font-size="12">{html.escape(category_label)}</text>'
    )
    parts.append("</svg>")
    return heading + "".join(parts)


_NICE_MS = (1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000, 2000, 5000, 10_000, 30_000, 60_000)


def latency_histogram(latencies: Sequence[float], buckets: int = 12) -> list[Bar]:
    """Counts per latency range, ranges a whole number of milliseconds wide (a "nice" step), so
    a small or narrow data set never gets ``1-1 ms`` buckets."""
    if not latencies:
        return []
    low, high = min(latencies), max(latencies)
    span = high - low
    step = next((s for s in _NICE_MS if s * buckets >= span), _NICE_MS[-1])
    start = math.floor(low / step) * step
    count = max(1, math.floor((high - start) / step) + 1)
    counts = [0] * count
    for value in latencies:
        counts[min(count - 1, int((value - start) // step))] += 1
    return [
        (f"{fmt_ms(start + i * step)} - {fmt_ms(start + (i + 1) * step)}", float(c))
        for i, c in enumerate(counts)
    ]


_BUCKETS_S = (1, 5, 10, 30, 60, 300, 900, 1800, 3600, 3 * 3600, 6 * 3600, 12 * 3600, 86_400)


def time_bucket_s(span_s: float, most: int = 24) -> int:
    """The smallest round bucket (1 s ... 1 day) giving at most ``most`` buckets for a span."""
    return next((b for b in _BUCKETS_S if span_s / b <= most), _BUCKETS_S[-1] * 7)


def _bucket_label(epoch: float, bucket_s: int) -> str:
    moment = datetime.fromtimestamp(epoch, UTC)
    if bucket_s >= 86_400:
        return moment.strftime("%Y-%m-%d")
    if bucket_s >= 60:
        return moment.strftime("%m-%d %H:%M")
    return moment.strftime("%H:%M:%S")


def cost_over_time(rows: Sequence[Mapping[str, Any]]) -> tuple[list[Bar], int]:
    """Cost per time bucket (bucket size from the span) and the bucket size; a bucket whose
    rows carry no price is ``None`` (drawn as "no price"), never zero."""
    stamped = [
        (float(r.get("created_at") or 0), r.get("cost"))
        for r in rows
        if not r.get("error") or r.get("cost") is not None
    ]
    if not stamped:
        return [], 0
    first, last = min(t for t, _ in stamped), max(t for t, _ in stamped)
    bucket = time_bucket_s(last - first)
    origin = math.floor(first / bucket) * bucket
    count = int((last - origin) // bucket) + 1
    totals: list[float | None] = [None] * count
    for ts, cost in stamped:
        if cost is None:
            continue
        index = int((ts - origin) // bucket)
        totals[index] = (totals[index] or 0.0) + float(cost)
    labels = [_bucket_label(origin + i * bucket, bucket) for i in range(count)]
    return list(zip(labels, totals, strict=True)), bucket


def _bucket_name(bucket_s: int) -> str:
    if bucket_s % 86_400 == 0:
        return f"{bucket_s // 86_400} d"
    if bucket_s % 3600 == 0:
        return f"{bucket_s // 3600} h"
    if bucket_s % 60 == 0:
        return f"{bucket_s // 60} min"
    return f"{bucket_s} s"


_NO_SOURCE = "(none: refused)"
"""How the errors chart names calls refused before any attempt."""


def render_html(report: Report, *, title: str = "PolyGateway telemetry", source: str = "") -> str:
    head = "".join(f"<th>{html.escape(label)}</th>" for _, label in _COLUMNS)
    body_rows = []
    for stats in [*report.groups, report.total]:
        row = stats.as_row()
        cells = "".join(
            f"<td>{html.escape(_cell(k, row[k], report.currency))}</td>" for k, _ in _COLUMNS
        )
        body_rows.append(f"<tr>{cells}</tr>")
    by_source = sorted(
        (
            (_NO_SOURCE if src == "-" else src, float(sum(c.values())))
            for src, c in report.errors_by_source.items()
        ),
        key=lambda kv: -(kv[1] or 0.0),
    )
    errors: list[Bar] = [(name, float(n)) for name, n in report.errors_by_class.most_common()]
    costs, bucket = cost_over_time(report.rows)
    money = report.currency or "price-table units"
    sections = [
        _svg_bars(
            latency_histogram(report.total.latencies),
            title="Latency of successful attempts",
            value_label="attempts",
            category_label="latency (ms)",
        ),
        _svg_bars(
            costs,
            title=f"Cost over time (per {_bucket_name(bucket)}, UTC)"
            if costs
            else "Cost over time",
            value_label=f"cost ({money})",
            category_label="time (UTC)",
            fmt=lambda v: fmt_cost(v, ""),
        ),
        _svg_bars(
            by_source,
            title="Errors by source",
            value_label="rows with an error",
            category_label="source",
        ),
        _svg_bars(errors, title="Errors by class", value_label="rows", category_label="class"),
    ]
    style = (
        "body{font-family:system-ui,sans-serif;margin:2em;color:#222}"
        "table{border-collapse:collapse;font-size:14px}td,th{border:1px solid #ccc;"
        "padding:4px 8px;text-align:right}td{white-space:nowrap}th{vertical-align:bottom}"
        "td:first-child,th:first-child{text-align:left}"
        "ul.totals{line-height:1.5}svg line{shape-rendering:crispEdges}"
    )
    where = html.escape(source or "telemetry rows")
    span = f"{fmt_time(report.first_at)} to {fmt_time(report.last_at)}"
    totals = "".join(f"<li>{html.escape(line)}</li>" for line in summary_lines(report))
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{style}</style></head><body><h1>{html.escape(title)}</h1>"
        f"<p>Database: <code>{where}</code><br>{fmt_count(len(report.rows))} rows from "
        f"{html.escape(span)}, grouped by {report.by}.</p><ul class='totals'>{totals}</ul>"
        f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body_rows)}</tbody></table>"
        + "".join(sections)
        + "</body></html>"
    )
