"""``pgw telemetry report``: tables (and an HTML page) from a telemetry database."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable


def configure(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    from polygateway.cli import HelpFormatter
    from polygateway.cli.telemetry_db import add_source_arguments

    parser.description = "Report calls, errors, latency, tokens and cost from a telemetry database."
    sub = parser.add_subparsers(dest="telemetry_command", required=True)
    report = sub.add_parser(
        "report",
        help="calls, attempts, cache hits, errors, latency, tokens and cost",
        description="Aggregate the telemetry rows: calls (answered or failed, each counted once "
        "by its root_call_id), attempts, cache hits and refused calls counted apart, latency "
        "of successful attempts, tokens and cost (in the price table's currency), by model, "
        "source, session, scope or namespace.",
        formatter_class=HelpFormatter,
    )
    add_source_arguments(report)
    report.add_argument("--since", help="only rows newer than this: 30m, 2h, 7d or an ISO date")
    report.add_argument(
        "--by",
        choices=("model", "source", "session", "scope", "namespace"),
        default="model",
        help="group rows by",
    )
    report.add_argument("--html", metavar="FILE", help="also write a self-contained HTML report")
    return run


def run(args: argparse.Namespace) -> int:
    from polygateway.cli import registry_of
    from polygateway.cli.telemetry_db import read_rows, resolve_source
    from polygateway.telemetry.report import build_report, parse_since, render_html, render_text

    source = resolve_source(args)
    try:
        rows = read_rows(source, registry_of(args), since=parse_since(args.since))
    except ValueError as exc:
        print(f"pgw telemetry report: {exc}", file=sys.stderr)
        return 2
    report = build_report(rows, by=args.by, currency=source.currency)
    sys.stdout.write(render_text(report, source=source.label))
    if args.html:
        with open(args.html, "w", encoding="utf-8") as fh:
            fh.write(render_html(report, source=source.label))
        print(f"HTML report written to {args.html}")
    return 0
