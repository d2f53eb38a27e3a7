"""``pgw logs``: browse recorded rows, in the manner of ``llm logs``.

``pgw logs`` prints the newest rows (``-n``), filtered by session, source, model, errors, age
or call (``--call``: every attempt of one call); ``pgw logs show CALL_ID`` prints one row in
full; ``pgw logs path`` the database file. Rows come from the database the configuration
names (``pgw telemetry report`` finds it the same way), or ``--db``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

_CONTENT = ("messages", "response", "thinking")


def configure(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    from polygateway.cli import HelpFormatter
    from polygateway.cli.telemetry_db import add_source_arguments

    parser.description = (
        "Browse recorded telemetry rows (one per attempt, cache hit or refused call): the "
        "newest first, filtered; `pgw logs show CALL_ID` for one row in full, `pgw logs path` "
        "for the database file."
    )
    add_source_arguments(parser)
    _filters(parser)
    actions = parser.add_subparsers(dest="logs_action", metavar="ACTION")
    show = actions.add_parser(
        "show",
        help="one row in full",
        description="Print every field of the row with this call id (a unique prefix works).",
        formatter_class=HelpFormatter,
    )
    show.add_argument("call_id", metavar="CALL_ID", help="the row's call_id (or a unique prefix)")
    show.add_argument("--json", dest="as_json", action="store_true", help="print JSON")
    add_source_arguments(show, inherit=True)
    path = actions.add_parser(
        "path",
        help="print the database file",
        description="Print the path of the telemetry database the configuration names.",
        formatter_class=HelpFormatter,
    )
    add_source_arguments(path, inherit=True)
    return run


def _filters(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-n", "--count", type=int, default=3, help="rows to show, newest first (0: all)"
    )
    parser.add_argument("--session", help="only rows of this session_id")
    parser.add_argument("--source", help="only rows of this source (e.g. qwen-1)")
    parser.add_argument("-m", "--model", help="only rows of this model")
    parser.add_argument("--errors", action="store_true", help="only rows with an error")
    parser.add_argument(
        "--call",
        metavar="CALL_ID",
        help="only the rows of this call (its root_call_id: retries, switches, re-asks)",
    )
    parser.add_argument("--since", help="only rows newer than this: 30m, 2h, 7d or an ISO date")
    parser.add_argument("--json", dest="as_json", action="store_true", help="print a JSON array")
    parser.add_argument(
        "-t", "--truncate", action="store_true", help="cut messages and responses to one line"
    )


def run(args: argparse.Namespace) -> int:
    from polygateway.cli import registry_of
    from polygateway.cli.telemetry_db import read_rows, resolve_source
    from polygateway.telemetry.report import parse_since

    source = resolve_source(args)
    if args.logs_action == "path":
        print(source.label if "://" in source.path else os.path.abspath(source.path))
        return 0
    try:
        since = None if args.logs_action == "show" else parse_since(args.since)
        rows = read_rows(source, registry_of(args), since=since)
    except ValueError as exc:
        print(f"pgw logs: {exc}", file=sys.stderr)
        return 2
    if args.logs_action == "show":
        return _show(rows, args.call_id, as_json=args.as_json)
    chosen = select(rows, args)
    if args.as_json:
        print(json.dumps([_decoded(row) for row in chosen], indent=2, default=str))
        return 0
    if not chosen:
        print(f"no rows match in {source.label}", file=sys.stderr)
        return 0
    print("\n\n".join(render_row(row, truncate=args.truncate) for row in chosen))
    return 0


def select(rows: Sequence[Mapping[str, Any]], args: argparse.Namespace) -> list[Mapping[str, Any]]:
    """The newest ``args.count`` rows passing the filters, newest first."""
    from polygateway.telemetry.report import call_of

    wanted = [
        row
        for row in rows
        if (args.session is None or row.get("session_id") == args.session)
        and (args.source is None or row.get("source_name") == args.source)
        and (args.model is None or row.get("model") == args.model)
        and (not args.errors or row.get("error"))
        and (args.call is None or call_of(row) == args.call)
    ]
    wanted.reverse()
    return wanted if args.count <= 0 else wanted[: args.count]


def _show(rows: Sequence[Mapping[str, Any]], call_id: str, *, as_json: bool) -> int:
    found = [row for row in rows if str(row.get("call_id", "")).startswith(call_id)]
    if len(found) != 1:
        what = "no row has" if not found else f"{len(found)} rows have"
        print(f"pgw logs show: {what} a call_id starting with {call_id!r}", file=sys.stderr)
        return 2
    row = found[0]
    if as_json:
        print(json.dumps(_decoded(row), indent=2, default=str))
    else:
        print(render_row(row, truncate=False, full=True))
    return 0


def _decoded(row: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(row)
    # A digest or a cleared value (PGW_TELEMETRY_CONTENT) is not JSON: kept as text.
    with contextlib.suppress(ValueError):
        out["messages"] = json.loads(str(row.get("messages") or "[]"))
    out["cache_hit"] = bool(row.get("cache_hit"))
    return out


def render_row(row: Mapping[str, Any], *, truncate: bool, full: bool = False) -> str:
    from polygateway.telemetry.report import call_of, fmt_cost, fmt_ms, fmt_time

    status = f"error {row['error']}" if row.get("error") else "ok"
    if row.get("cache_hit"):
        status = "cache hit"
    if call_of(row) != row.get("call_id"):  # not the call's first attempt
        status += f"  (call {call_of(row)})"
    head = (
        f"## {fmt_time(row.get('created_at'))}  {row.get('call_id')}  {status}\n"
        f"model {row.get('model') or '-'}  source {row.get('source_name') or '-'}  "
        f"session {row.get('session_id') or '-'}  latency {fmt_ms(row.get('latency_ms'))}  "
        f"TTFT {fmt_ms(row.get('ttft_ms'))}  tokens {row.get('prompt_tokens')}+"
        f"{row.get('completion_tokens')} ({row.get('usage_source')})  cost "
        f"{fmt_cost(row.get('cost'), '')}"
    )
    parts = [head]
    if full:
        rest = {k: v for k, v in row.items() if k not in _CONTENT}
        parts.append("\n".join(f"{k}: {'-' if v is None else v}" for k, v in rest.items()))
    parts.append("### prompt\n" + _prompt(row, truncate))
    if row.get("thinking"):
        parts.append("### thinking\n" + _clip(str(row["thinking"]), truncate))
    parts.append("### response\n" + (_clip(str(row.get("response") or ""), truncate) or "-"))
    return "\n".join(parts)


def _prompt(row: Mapping[str, Any], truncate: bool) -> str:
    raw = str(row.get("messages") or "")
    try:
        messages = json.loads(raw)
    except ValueError:
        return _clip(raw, truncate) or "-"
    if not isinstance(messages, list):
        return _clip(raw, truncate)
    lines = []
    for message in messages:
        if isinstance(message, dict):
            content = message.get("content")
            text = content if isinstance(content, str) else json.dumps(content)
            lines.append(f"{message.get('role', '?')}: {_clip(text, truncate)}")
    return "\n".join(lines) or "-"


def _clip(text: str, truncate: bool) -> str:
    if not truncate:
        return text
    line = " ".join(text.split())
    return line if len(line) <= 100 else line[:99] + "…"
