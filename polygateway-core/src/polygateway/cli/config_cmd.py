"""``pgw config check``: resolve env/.env and the pipeline file, run the guards, show the result.

Problems go to stderr, one line each naming the key (exit code 2); the resolved pipeline of
every scope goes to stdout, secrets masked.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from polygateway.errors import ConfigError

if TYPE_CHECKING:
    from polygateway.settings import ScopeSettings


def configure(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    parser.description = "Check the configuration (environment, .env, pipeline file)."
    # ``pgw config`` alone runs the check with its defaults.
    parser.set_defaults(pipeline_path=None, env_file=None, scopes=None, as_json=False)
    parser.epilog = "Exit status: 0 when the configuration is usable, 2 on any problem."
    actions = parser.add_subparsers(dest="config_action", metavar="ACTION")
    from polygateway.cli import HelpFormatter, add_config_arguments

    check = actions.add_parser(
        "check",
        formatter_class=HelpFormatter,
        help="resolve every scope and run the assembly guards (the default action)",
        description="Load the environment, .env and the pipeline file, resolve every scope, "
        "run the assembly guards, load the pricing file and print the resolved pipeline "
        "(secrets masked) with the values the code derives. On problems (no scope at all is "
        "one), print one line per problem to stderr and exit with 2; --json prints "
        '{"ok", "scopes", "warnings", "errors"} instead.',
    )
    add_config_arguments(check)
    check.add_argument(
        "--scope",
        dest="scopes",
        metavar="SCOPE",
        action="extend",
        nargs="+",
        help="show only these scopes (every scope is still checked)",
    )
    check.add_argument("--json", dest="as_json", action="store_true", help="print JSON")
    return run


NO_SCOPE = (
    "no scope is configured: set {SCOPE}__{PROVIDER}__{N}__BASE_URL and __MODEL (e.g. "
    "LLM__OPENAI__1__BASE_URL=https://api.openai.com/v1 and LLM__OPENAI__1__MODEL=gpt-4o-mini, "
    "plus LLM__OPENAI__1__API_KEY), in the environment, .env or as [[scopes.LLM.sources]] in "
    "the pipeline file (pgw.example.toml shows every key)"
)


def run(namespace: argparse.Namespace) -> int:
    from polygateway.cli import registry_of
    from polygateway.config import describe_settings, load_settings

    errors: list[str] = []
    chosen: dict[str, Any] = {}
    scopes: dict[str, Any] = {}
    warnings: list[str] = []
    try:
        settings = load_settings(
            None,
            pipeline_path=namespace.pipeline_path,
            dotenv_path=namespace.env_file,
            registry=registry_of(namespace),
        )
    except ConfigError as exc:
        errors.extend(exc.problems)
    else:
        described = describe_settings(settings)
        scopes = scope_descriptions(described)
        warnings = [str(w) for w in described.get("warnings", ())]
        if not scopes:
            errors.append(NO_SCOPE)
        errors.extend(pricing_problems(settings.scopes.values()))
        chosen = select_scopes(scopes, namespace.scopes)
    if namespace.as_json:
        report = {"ok": not errors, "scopes": chosen, "warnings": warnings, "errors": errors}
        print(json.dumps(report, indent=2, default=str))
        return 2 if errors else 0
    for warning in warnings:
        print(f"pgw config check: warning: {warning}", file=sys.stderr)
    if errors:
        for problem in errors:
            print(f"pgw: {problem}", file=sys.stderr)
        return 2
    for name, description in chosen.items():
        print(f"scope {name}")
        print("\n".join(render_scope(description)))
        print()
    print(f"configuration OK: {len(scopes)} scope(s): {', '.join(scopes)}")
    return 0


def pricing_problems(scopes: Iterable[ScopeSettings]) -> list[str]:
    """Each pricing file a scope names, loaded and validated as assembly will load it."""
    from polygateway.telemetry.pricing import PricingTable

    problems: list[str] = []
    for path in dict.fromkeys(s.pricing_path for s in scopes if s.pricing_path):
        try:
            PricingTable.from_file(path)
        except ConfigError as exc:
            problems.extend(f"PGW_PRICING_PATH / pricing_path: {line}" for line in exc.problems)
    return problems


def scope_descriptions(described: Mapping[str, Any]) -> dict[str, Any]:
    """Scope name -> its description, whether or not the loader nests them under ``scopes``."""
    scopes = described.get("scopes", described)
    return dict(scopes) if isinstance(scopes, Mapping) else {}


def select_scopes(described: Mapping[str, Any], wanted: Sequence[str] | None) -> dict[str, Any]:
    if not wanted:
        return dict(described)
    by_upper = {name.upper(): name for name in described}
    unknown = [name for name in wanted if name not in described and name.upper() not in by_upper]
    if unknown:
        configured = ", ".join(described) or "none"
        raise ConfigError(
            [f"--scope {name}: unknown scope; configured scopes: {configured}" for name in unknown]
        )
    chosen = [name if name in described else by_upper[name.upper()] for name in wanted]
    return {name: described[name] for name in dict.fromkeys(chosen)}


def render_scope(description: Any) -> Iterator[str]:
    """The middleware chain first (outer -> inner, the transport innermost), then the rest."""
    if not isinstance(description, Mapping):
        yield from render(description, indent=1)
        return
    layers = description.get("middleware")
    if isinstance(layers, list | tuple):
        yield "  pipeline: " + " -> ".join([*map(str, layers), "transport"])
    rest = {k: v for k, v in description.items() if k not in ("scope", "middleware")}
    yield from render(rest, indent=1)


def render(value: Any, indent: int = 0) -> Iterator[str]:
    """Nested mappings and lists as indented ``key: value`` lines."""
    pad = "  " * indent
    if isinstance(value, Mapping):
        for key, item in value.items():
            if _is_scalar(item) or _is_scalar_list(item):
                yield f"{pad}{key}: {_scalar(item)}"
            elif not item:
                yield f"{pad}{key}: -"
            else:
                yield f"{pad}{key}:"
                yield from render(item, indent + 1)
    elif isinstance(value, list | tuple):
        for item in value:
            if _is_scalar(item) or _is_scalar_list(item):
                yield f"{pad}- {_scalar(item)}"
            else:
                lines = list(render(item, indent + 1))
                yield f"{pad}- {lines[0].lstrip()}" if lines else f"{pad}- -"
                yield from lines[1:]
    else:
        yield f"{pad}{_scalar(value)}"


def _is_scalar(value: Any) -> bool:
    return not isinstance(value, Mapping | list | tuple)


def _is_scalar_list(value: Any) -> bool:
    return isinstance(value, list | tuple) and bool(value) and all(map(_is_scalar, value))


def _scalar(value: Any) -> str:
    if isinstance(value, list | tuple):
        return ", ".join(_scalar(item) for item in value)
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
