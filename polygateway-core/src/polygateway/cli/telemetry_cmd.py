"""``pgw telemetry report``: tables (and an HTML page) from a telemetry database."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable


def configure(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    parser.description = "Report calls, errors, latency, tokens and cost from a telemetry database."
    sub = parser.add_subparsers(dest="telemetry_command", required=True)
    report = sub.add_parser("report", help="calls, errors, latency, tokens and cost")
    report.add_argument("--db", default="pgw_telemetry.db", help="SQLite telemetry file")
    report.add_argument("--since", help="30m, 2h, 7d or an ISO date")
    report.add_argument(
        "--by", choices=("model", "source", "session", "scope", "namespace"), default="model"
    )
    report.add_argument("--html", metavar="FILE", help="also write a self-contained HTML report")
    return run


def run(args: argparse.Namespace) -> int:
    import os

    from polygateway.telemetry.report import (
        build_report,
        parse_since,
        read_sqlite_rows,
        render_html,
        render_text,
    )

    if not os.path.exists(args.db):
        print(f"pgw telemetry report: --db {args.db}: no such file", file=sys.stderr)
        return 2
    try:
        rows = read_sqlite_rows(args.db, since=parse_since(args.since))
    except ValueError as exc:
        print(f"pgw telemetry report: {exc}", file=sys.stderr)
        return 2
    report = build_report(rows, by=args.by)
    sys.stdout.write(render_text(report))
    if args.html:
        with open(args.html, "w", encoding="utf-8") as fh:
            fh.write(render_html(report))
        print(f"HTML report written to {args.html}")
    return 0
