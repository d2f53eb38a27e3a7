"""``pgw plugins list [--json]``: installed plugins, their status and what each provides."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from typing import Any

from polygateway.plugins import PluginInfo


def configure(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    parser.description = "Show installed plugins, their status and what each one provides."
    actions = parser.add_subparsers(dest="plugins_action", metavar="ACTION")
    from polygateway.cli import HelpFormatter

    listing = actions.add_parser(
        "list",
        formatter_class=HelpFormatter,
        help="list plugins (the default action)",
        description="List every plugin (the builtin one too): distribution, version, status "
        "and the names it registers per kind.",
    )
    listing.add_argument(
        "--json", action="store_true", dest="as_json", help="print a JSON array instead"
    )
    return run


def run(namespace: argparse.Namespace) -> int:
    from polygateway.cli import registry_of

    plugins = registry_of(namespace).plugins
    if getattr(namespace, "as_json", False):
        print(json.dumps([plugin_as_json(p) for p in plugins], indent=2))
    else:
        print(render_table(plugins))
    return 0


def plugin_as_json(plugin: PluginInfo) -> dict[str, Any]:
    return {
        "name": plugin.name,
        "version": plugin.version,
        "entry_point": plugin.entry_point,
        "hooks": list(plugin.hooks),
        "provides": {kind: list(names) for kind, names in plugin.provides.items()},
        "status": plugin.status,
        "error": plugin.error,
        "hint": plugin.install_hint if plugin.status == "failed" else None,
    }


def render_table(plugins: Sequence[PluginInfo]) -> str:
    """One block per plugin; the last column spans one line per kind (or the error)."""
    header = ("DISTRIBUTION", "VERSION", "STATUS", "PROVIDES")
    rows: list[tuple[str, str, str, list[str]]] = []
    for plugin in plugins:
        details = [f"{kind}: {', '.join(names)}" for kind, names in plugin.provides.items()]
        if plugin.status == "failed":
            details += [f"error: {plugin.error}", f"hint: {plugin.install_hint}"]
        rows.append((plugin.name, plugin.version, plugin.status, details or ["-"]))
    widths = [
        max(len(header[column]), *(len(row[column]) for row in rows)) if rows else len(header[0])
        for column in range(3)
    ]

    def line(cells: Sequence[str], detail: str) -> str:
        left = "  ".join(cell.ljust(width) for cell, width in zip(cells, widths, strict=True))
        return f"{left}  {detail}".rstrip()

    out = [line(header[:3], header[3])]
    for name, version, status, details in rows:
        out.append(line((name, version, status), details[0]))
        out.extend(line(("", "", ""), detail) for detail in details[1:])
    return "\n".join(out)
