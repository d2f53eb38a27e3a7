"""``pgw telemetry report``: tables (and an HTML page) from a telemetry database.

Rows come from a registered ``telemetry_reader``: ``sqlite`` for ``--db PATH``, the reader
named by the URL's scheme for ``--dsn URL`` (``postgresql://`` with pgw-postgres installed).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable


def configure(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    parser.description = "Report calls, errors, latency, tokens and cost from a telemetry database."
    sub = parser.add_subparsers(dest="telemetry_command", required=True)
    report = sub.add_parser("report", help="calls, errors, latency, tokens and cost")
    where = report.add_mutually_exclusive_group()
    where.add_argument("--db", default="pgw_telemetry.db", help="SQLite telemetry file")
    where.add_argument(
        "--dsn", metavar="URL", help="telemetry database URL (read by the reader its scheme names)"
    )
    report.add_argument("--since", help="30m, 2h, 7d or an ISO date")
    report.add_argument("--by", choices=("model", "source", "session"), default="model")
    report.add_argument("--html", metavar="FILE", help="also write a self-contained HTML report")
    return run


def run(args: argparse.Namespace) -> int:
    import os

    from polygateway.cli import registry_of
    from polygateway.telemetry.report import build_report, parse_since, render_html, render_text

    registry = registry_of(args)
    if args.dsn is not None:
        # The URL's scheme names the reader; "postgresql+asyncpg://" is read by "postgresql".
        scheme = args.dsn.partition("://")[0].partition("+")[0].lower()
        if "://" not in args.dsn or not scheme.isalnum():
            scheme = "?"  # whatever it is, it may hold a password: not shown
        readers = registry.names("telemetry_reader")
        if scheme not in readers:
            print(
                f"pgw telemetry report: --dsn: no telemetry reader for scheme {scheme!r} "
                f"(readers: {', '.join(readers)}; plugins add readers)",
                file=sys.stderr,
            )
            return 2
        target, reader = args.dsn, registry.get("telemetry_reader", scheme)
    elif not os.path.exists(args.db):
        print(f"pgw telemetry report: --db {args.db}: no such file", file=sys.stderr)
        return 2
    else:
        target, reader = args.db, registry.get("telemetry_reader", "sqlite")
    try:
        rows = reader(target, since=parse_since(args.since))
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
