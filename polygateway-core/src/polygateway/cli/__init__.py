"""The ``pgw`` command line. Subcommands come from the ``command`` kind of the plugin registry.

A command is registered as ``configure(parser) -> run`` and ``run(namespace) -> int``; the
namespace handed to ``run`` also carries ``registry`` (the loaded ``Registry``). Only the invoked
command is configured (imported), so one broken command never breaks the others, and
``pgw --version`` loads no plugin at all.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from polygateway import __version__
from polygateway.errors import ConfigError

if TYPE_CHECKING:
    from polygateway.plugins import Registry

Runner = Callable[[argparse.Namespace], int]

DESCRIPTION = "PolyGateway: a governed asyncio gateway for model calls."


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``pgw`` console script; returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    options, invoked = _split_command(args)
    if "--version" in options or "-V" in options:
        print(f"pgw {__version__}")
        return 0

    from polygateway.config import plugin_filter
    from polygateway.plugins import load_registry

    # PGW_PLUGINS is read as from_env reads it (env, .env, the file), with the files the
    # command names, so that the CLI and the library load the same plugins.
    dotenv_path, pipeline_path = _config_paths(args)
    try:
        allowed = plugin_filter(None, dotenv_path=dotenv_path, pipeline_path=pipeline_path)
        registry = load_registry(allowed=allowed)
    except ConfigError as exc:
        return _report(exc)

    parser = argparse.ArgumentParser(
        prog="pgw", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-V", "--version", action="version", version=f"pgw {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    runners: dict[str, Runner] = {}
    failures: dict[str, str] = {}
    listing: list[tuple[str, str]] = []
    for name in registry.names("command"):
        sub = subparsers.add_parser(name, formatter_class=HelpFormatter)
        # Configuring imports the command's module: only the one invoked, or all for --help.
        if invoked is not None and name != invoked:
            continue
        try:
            runners[name] = registry.get("command", name)(sub)
        # A command comes from a plugin (or an unfinished module): keep its error for its turn.
        except Exception as exc:  # noqa: BLE001
            failures[name] = f"{type(exc).__name__}: {exc}"
        listing.append((name, _summary(sub, failures.get(name))))
    parser.epilog = _commands_epilog(listing)

    if invoked in failures:
        provider = registry.provider_of("command", invoked)
        print(
            f"pgw: command {invoked!r} (from {provider}) is unavailable: ", end="", file=sys.stderr
        )
        print(failures[invoked], file=sys.stderr)
        return 2
    try:
        namespace = parser.parse_args(args)
    except SystemExit as exc:  # argparse exits on --help and on usage errors
        return exc.code if isinstance(exc.code, int) else 2
    if namespace.command is None:
        parser.print_help()
        return 2
    namespace.registry = registry
    try:
        return runners[namespace.command](namespace)
    except ConfigError as exc:
        return _report(exc)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every command's ``--help`` shows each option's default (unless its help already says,
    or there is none to show) and keeps its description's lines."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or default in (None, False, argparse.SUPPRESS)
            or not action.option_strings
        ):
            return text
        return f"{text} (default: {default})"


ENV_FILE_FLAG = "--env-file"
CONFIG_FLAG = "--config"


def add_config_arguments(parser: argparse.ArgumentParser, *, inherit: bool = False) -> None:
    """The two flags every command that reads the configuration takes, named alike.

    ``inherit``: on an action's subparser, so that ``pgw logs --config X show`` keeps ``X``
    (a subparser's own defaults would overwrite what the parent parsed).
    """
    default = argparse.SUPPRESS if inherit else None
    parser.add_argument(
        CONFIG_FLAG,
        dest="pipeline_path",
        metavar="PATH",
        default=default,
        help="pipeline file (default: $PGW_CONFIG, else ./pgw.toml if present)",
    )
    parser.add_argument(
        ENV_FILE_FLAG,
        dest="env_file",
        metavar="PATH",
        default=default,
        help=".env file read under the environment (default: ./.env if present)",
    )


def _config_paths(args: Sequence[str]) -> tuple[str | None, str | None]:
    """The ``--env-file`` and ``--config`` values in ``args`` (before the command parses them)."""
    found: dict[str, str | None] = {ENV_FILE_FLAG: None, CONFIG_FLAG: None}
    for index, arg in enumerate(args):
        flag, equals, value = arg.partition("=")
        if flag in found:
            if equals:
                found[flag] = value
            elif index + 1 < len(args):
                found[flag] = args[index + 1]
    return found[ENV_FILE_FLAG], found[CONFIG_FLAG]


def _split_command(args: Sequence[str]) -> tuple[list[str], str | None]:
    """Top-level options before the command, and the command name (first non-option)."""
    for index, arg in enumerate(args):
        if not arg.startswith("-"):
            return list(args[:index]), arg
    return list(args), None


def _summary(parser: argparse.ArgumentParser, failure: str | None) -> str:
    if failure is not None:
        return "(unavailable: run it to see why)"
    description = (parser.description or "").strip()
    return description.splitlines()[0] if description else ""


def _commands_epilog(listing: Sequence[tuple[str, str]]) -> str:
    if not listing:
        return "no commands are registered"
    width = max(len(name) for name, _ in listing)
    lines = [f"  {name.ljust(width)}  {summary}".rstrip() for name, summary in listing]
    return "commands:\n" + "\n".join(lines) + "\n\nrun `pgw COMMAND --help` for a command's options"


def _report(exc: ConfigError) -> int:
    for problem in exc.problems:
        print(f"pgw: {problem}", file=sys.stderr)
    return 2


def registry_of(namespace: argparse.Namespace) -> Registry:
    """The registry ``main`` loaded, for commands that need it."""
    registry: Registry = namespace.registry
    return registry
