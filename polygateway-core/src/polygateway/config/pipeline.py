"""The declarative pipeline file (TOML): where it is, what it holds, how its keys are named.

Shape (``pgw.example.toml`` documents every key)::

    [defaults]                 # a scope table without sources; applies to every scope
    [scopes.LLM]               # one table per scope (logical role)
    [[scopes.LLM.sources]]     # one entry per upstream account

This module checks only the outer shape; each table is validated by ``models.py``.
Keys are named in problems as ``<file>:[table.path].key``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polygateway.config.env import CONFIG_PATH_KEY
from polygateway.config.models import Loc
from polygateway.config.suggest import did_you_mean
from polygateway.frozen import value_methods

DEFAULT_FILE = "pgw.toml"
TOP_LEVEL_KEYS: tuple[str, ...] = ("defaults", "ignore_keys", "plugins", "scopes")
_SCOPE_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9]*(?:_[A-Za-z0-9]+)*$")
_BARE_KEY = re.compile(r"^[A-Za-z0-9_\-]+$")


@value_methods
@dataclass(repr=False, eq=False)
class FileScope:
    """One ``[scopes.X]`` table split into its settings and its source entries."""

    name: str
    """Upper-case scope name (env spelling)."""
    table_key: str
    """The key as written in the file (for naming keys in problems)."""
    settings: dict[str, Any]
    sources: list[dict[str, Any] | None]
    """Source entries in file order; ``None`` for an entry that is not a table (reported)."""


@value_methods
@dataclass(repr=False, eq=False)
class PipelineFile:
    path: str
    """The path as given (how problems name the file)."""
    root: dict[str, Any]
    defaults: dict[str, Any] | None = None
    scopes: dict[str, FileScope] = field(default_factory=dict)
    plugins: list[str] | None = None
    """Top-level ``plugins = [...]``: the plugin filter when ``PGW_PLUGINS`` is not set."""
    ignore_keys: list[str] | None = None
    """Top-level ``ignore_keys = [...]``: other tools' env keys (``PGW_CONFIG_IGNORE_KEYS``
    when that is not set)."""

    def key(self, loc: Loc) -> str:
        """``path:[table.path].key`` for a path from the file's root."""
        return toml_key_label(self.path, self.root, loc)

    def scope_key(self, scope: FileScope, loc: Loc) -> str:
        return self.key(("scopes", scope.table_key, *loc))

    def source_key(self, scope: FileScope, index: int, loc: Loc) -> str:
        return self.key(("scopes", scope.table_key, "sources", index, *loc))


def _toml_key(part: str | int) -> str:
    text = str(part)
    return text if _BARE_KEY.match(text) else json.dumps(text, ensure_ascii=False)


def toml_key_label(path: str, root: Mapping[str, Any], loc: Sequence[str | int]) -> str:
    """Name a key by its table and key, e.g. ``pgw.toml:[scopes.LLM.sources[0]].model``."""
    tables: list[str] = []
    node: Any = root
    i = 0
    while i < len(loc) - 1:
        part = loc[i]
        child = node.get(part) if isinstance(node, Mapping) and isinstance(part, str) else None
        if isinstance(child, Mapping):
            tables.append(_toml_key(part))
            node, i = child, i + 1
            continue
        nxt = loc[i + 1]
        if (
            isinstance(child, list)
            and i + 2 < len(loc)
            and isinstance(nxt, int)
            and 0 <= nxt < len(child)
            and isinstance(child[nxt], Mapping)
        ):
            tables.append(f"{_toml_key(part)}[{nxt}]")
            node, i = child[nxt], i + 2
            continue
        break
    rest = loc[i:]
    leaf = "".join(
        f"[{p}]" if isinstance(p, int) else (f".{_toml_key(p)}" if n else _toml_key(p))
        for n, p in enumerate(rest)
    )
    return f"{path}:[{'.'.join(tables)}].{leaf}" if tables else f"{path}:{leaf}"


def locate(
    env: Mapping[str, str], pipeline_path: str | os.PathLike[str] | None
) -> tuple[Path | None, str | None]:
    """The pipeline file to read and, when an explicitly named file is missing, the problem.

    ``pipeline_path`` (e.g. ``pgw config check --file``) wins over ``PGW_CONFIG``; without
    either, ``./pgw.toml`` when present; no file means defaults.
    """
    if pipeline_path is not None:
        path = Path(pipeline_path)
        if not path.is_file():
            return None, f"pipeline_path: file not found: {pipeline_path}"
        return path, None
    configured = env.get(CONFIG_PATH_KEY, "").strip()
    if configured:
        path = Path(configured)
        if not path.is_file():
            return None, f"{CONFIG_PATH_KEY}: file not found: {configured}"
        return path, None
    default = Path(DEFAULT_FILE)
    return (default, None) if default.is_file() else (None, None)


def _string_list(
    pipeline: PipelineFile, key: str, problems: list[str], what: str
) -> list[str] | None:
    """A top-level list of strings (blank items dropped); ``None`` when absent or refused."""
    value = pipeline.root.get(key)
    if value is None:
        return None
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return [item.strip() for item in value if item.strip()]
    problems.append(f"{pipeline.key((key,))}: must be a list of {what}")
    return None


def read(path: Path) -> tuple[PipelineFile | None, list[str]]:
    """Parse the file and split it into defaults and scopes; problems name the file's keys."""
    import tomllib  # only when there is a file: most configurations have none

    label = str(path)
    try:
        with path.open("rb") as handle:
            root = tomllib.load(handle)
    except tomllib.TOMLDecodeError as exc:
        return None, [f"{label}: invalid TOML: {exc}"]
    except OSError as exc:
        return None, [f"{label}: cannot read: {exc.strerror or exc}"]

    problems: list[str] = []
    pipeline = PipelineFile(path=label, root=root)
    for key in root:
        if key not in TOP_LEVEL_KEYS:
            problems.append(
                f"{pipeline.key((key,))}: unknown key{did_you_mean(key, TOP_LEVEL_KEYS)}; "
                f"allowed: {', '.join(TOP_LEVEL_KEYS)}"
            )

    pipeline.plugins = _string_list(
        pipeline,
        "plugins",
        problems,
        'distribution or entry-point names, e.g. plugins = ["my-plugin"]',
    )
    pipeline.ignore_keys = _string_list(
        pipeline,
        "ignore_keys",
        problems,
        'env key names or patterns, e.g. ignore_keys = ["LLM_USER_PATH", "LLM_LOG_*"]',
    )

    defaults = root.get("defaults")
    if defaults is not None:
        if not isinstance(defaults, dict):
            problems.append(f"{pipeline.key(('defaults',))}: must be a table")
        elif "sources" in defaults:
            problems.append(
                f"{pipeline.key(('defaults', 'sources'))}: sources belong to a scope: "
                "use [[scopes.<SCOPE>.sources]]"
            )
            pipeline.defaults = {k: v for k, v in defaults.items() if k != "sources"}
        else:
            pipeline.defaults = defaults

    scopes = root.get("scopes")
    if scopes is not None and not isinstance(scopes, dict):
        problems.append(f"{pipeline.key(('scopes',))}: must be a table of [scopes.<SCOPE>] tables")
        scopes = None
    for table_key, table in (scopes or {}).items():
        if not _SCOPE_NAME.match(table_key):
            problems.append(
                f"{pipeline.key(('scopes', table_key))}: a scope name is letters and digits with "
                "single '_' between them (it is also the env prefix, e.g. LLM, VL_JUDGE)"
            )
            continue
        if not isinstance(table, dict):
            problems.append(f"{pipeline.key(('scopes', table_key))}: must be a table")
            continue
        name = table_key.upper()
        if name in pipeline.scopes:
            other = pipeline.scopes[name].table_key
            problems.append(
                f"{pipeline.key(('scopes', table_key))}: same scope as [scopes.{other}] "
                "(scope names are case-insensitive)"
            )
            continue
        settings = {k: v for k, v in table.items() if k != "sources"}
        raw_sources = table.get("sources", [])
        sources: list[dict[str, Any] | None] = []
        if not isinstance(raw_sources, list):
            problems.append(
                f"{pipeline.key(('scopes', table_key, 'sources'))}: must be an array of tables "
                f"([[scopes.{table_key}.sources]])"
            )
        else:
            for index, entry in enumerate(raw_sources):
                if isinstance(entry, dict):
                    sources.append(entry)
                else:
                    problems.append(
                        f"{pipeline.key(('scopes', table_key, 'sources', index))}: must be a table"
                    )
                    sources.append(None)
        pipeline.scopes[name] = FileScope(name, table_key, settings, sources)
    return pipeline, problems
