"""Layers and precedence: how the values of several origins merge into one scope's values.

Precedence, lowest to highest (more specific wins; at the same level env wins over the file):

1. built-in defaults (``polygateway.settings``);
2. the file's ``[defaults]`` table;
3. flat env keys (``LLM_TIMEOUT``, ``LLM_MAX_RETRIES``..., ``PGW_*_BACKEND``);
4. the file's ``[scopes.X]`` table (its ``source_defaults`` for source fields);
5. ``{SCOPE}__...`` env keys;

and for one source's fields, above all of those: its ``[[scopes.X.sources]]`` entry, then its
``{SCOPE}__{PROVIDER}__{N}__{FIELD}`` env keys. Within one layer a specific key beats the
``state`` shorthand. Each merged leaf remembers the key that set it, so problems name it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from polygateway.config.models import Loc
from polygateway.frozen import value_methods

STATE_TARGETS: dict[Loc, str] = {
    ("limiter", "name"): "limiter",
    ("breaker", "backend"): "breaker",
    ("cache", "backend"): "cache",
}
"""What the ``state`` shorthand (``PGW_STATE_BACKEND``) sets."""

Label = Callable[[Loc], str]


def rejected_names(raw: Mapping[str, Any], accepted: Mapping[str, Any]) -> set[str]:
    """Names of the values given in ``raw`` that validation dropped."""
    names: set[str] = set()
    for name, value in raw.items():
        kept = accepted.get(name)
        if kept is None:
            names.add(name)
            if isinstance(value, Mapping):
                names |= rejected_names(value, {})
        elif isinstance(value, Mapping) and isinstance(kept, Mapping):
            names |= rejected_names(value, kept)
    return names


@value_methods
@dataclass(repr=False, eq=False)
class Layer:
    data: dict[str, Any]
    label: Label


@value_methods
@dataclass(repr=False, eq=False)
class Resolved:
    """Merged values plus, for each leaf, the key that set it (for messages)."""

    values: dict[str, Any] = field(default_factory=dict)
    keys: dict[Loc, str] = field(default_factory=dict)

    def table(self, name: str) -> dict[str, Any]:
        found = self.values.get(name)
        return found if isinstance(found, dict) else {}


def merge(
    target: dict[str, Any],
    keys: dict[Loc, str],
    data: Mapping[str, Any],
    label: Label,
    path: Loc = (),
) -> None:
    for name, value in data.items():
        here = (*path, name)
        if isinstance(value, dict):
            node = target.get(name)
            if not isinstance(node, dict):
                node = target[name] = {}
            merge(node, keys, value, label, here)
        else:
            target[name] = copy.deepcopy(value)
            keys[here] = label(here)


def get_path(data: Mapping[str, Any], path: Loc) -> Any:
    node: Any = data
    for part in path:
        if not isinstance(node, Mapping):
            return None
        node = node.get(part)
    return node


def set_path(data: dict[str, Any], path: Loc, value: Any) -> None:
    node = data
    for part in path[:-1]:
        child = node.get(str(part))
        if not isinstance(child, dict):
            child = node[str(part)] = {}
        node = child
    node[str(path[-1])] = value


def resolve_layers(layers: list[Layer]) -> Resolved:
    resolved = Resolved()
    for layer in layers:
        merge(resolved.values, resolved.keys, layer.data, layer.label)
        state = layer.data.get("state")
        if state is None:
            continue
        for path in STATE_TARGETS:
            if get_path(layer.data, path) is None:
                set_path(resolved.values, path, state)
                resolved.keys[path] = layer.label(("state",))
    return resolved


def with_env_refs(
    data: dict[str, Any], label: Label, env: Mapping[str, str], pairs: list[tuple[Loc, Loc]]
) -> tuple[dict[str, Any], Label, list[str]]:
    """Replace ``*_env`` indirections (``api_key_env = "QWEN_KEY"``) by the env value they name.

    Secrets belong in the environment; the file names the variable. The value takes the place
    (and the precedence) of the inline key, and messages name the ``*_env`` key.
    """
    problems: list[str] = []
    renamed: dict[Loc, Loc] = {}
    for inline, indirect in pairs:
        var = get_path(data, indirect)
        if var is None:
            continue
        parent = get_path(data, indirect[:-1]) if len(indirect) > 1 else data
        if isinstance(parent, dict):
            parent.pop(str(indirect[-1]), None)
        if get_path(data, inline) is not None:
            problems.append(
                f"{label(inline)}: set only one of {inline[-1]} and {indirect[-1]} "
                f"(prefer {indirect[-1]}: secrets belong in the environment)"
            )
            continue
        value = env.get(var, "").strip()
        if not value:
            problems.append(f"{label(indirect)}: env key {var} is not set")
            continue
        set_path(data, inline, value)
        renamed[inline] = indirect

    def relabel(loc: Loc) -> str:
        return label(renamed.get(loc, loc))

    return data, relabel, problems
