"""Component options: the values of the components a scope picks, validated by their models.

A plugin registers a factory with an options model (``register(name, factory,
options=Model)``, see ``polygateway.options``). For every component a scope picks (limiter,
breaker, cache, telemetry, each middleware layer) whose registration has a model, the values
come from the layers in their usual precedence (``merge.py``) plus the flat env keys the model
declares (``EnvKey``, ranked with the core's flat keys), ``<option>_env`` indirections in the
file are resolved, and the model validates the result. Problems name the key the user wrote;
a missing required option names the key that would set it and the key that picked the
component. Nothing here knows a plugin: everything comes from the registry.

A model registered by reference (``OptionsRef``) is imported only when its options are
validated: the unknown-key check reads the reference's ``env_keys``, and a reference with a
plain reader gives its plain value when the reader is sure of every picked component's options
(the core's memory cache and sqlite recorder, so the default configuration needs no pydantic).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from polygateway.config.guards import NameRegistry
from polygateway.config.merge import Layer, Resolved, get_path, resolve_layers, with_env_refs
from polygateway.config.models import Loc
from polygateway.frozen import frozen_dataclass, value_methods
from polygateway.settings import ScopeSettings, TelemetrySettings

if TYPE_CHECKING:
    from pydantic import BaseModel

    from polygateway.options import OptionsRef

DEFAULT_BACKEND = "memory"
NO_BACKEND = "none"
# The settings' own defaults, so that the two never disagree.
DEFAULT_TELEMETRY: str = TelemetrySettings().backend
DEFAULT_MIDDLEWARE: tuple[str, ...] = ScopeSettings(scope="", sources=()).middleware


class OptionsRegistry(Protocol):
    """What the loader needs of ``polygateway.plugins.Registry`` for options."""

    def names(self, kind: str) -> Sequence[str]: ...

    def options_of(self, kind: str, name: str) -> type[BaseModel] | None: ...

    def declared_options(self, kind: str, name: str) -> type[BaseModel] | OptionsRef | None: ...

    def flat_env_keys(self) -> Sequence[tuple[str, str, Mapping[str, str]]]: ...


class ConfigRegistry(OptionsRegistry, NameRegistry, Protocol):
    """What ``load_settings(registry=...)`` needs: names (checked) and options models."""


@frozen_dataclass(slots=True)
class Slot:
    """Where a scope picks a component of one kind, and where its options live."""

    kind: str
    name_path: Loc
    options_path: Loc
    default: str
    env_group: str


SLOTS: tuple[Slot, ...] = (
    Slot("limiter", ("limiter", "name"), ("limiter", "options"), DEFAULT_BACKEND, "LIMITER"),
    Slot("breaker", ("breaker", "backend"), ("breaker", "options"), DEFAULT_BACKEND, "BREAKER"),
    Slot("cache", ("cache", "backend"), ("cache", "options"), DEFAULT_BACKEND, "CACHE"),
    Slot(
        "telemetry",
        ("telemetry", "backend"),
        ("telemetry", "options"),
        DEFAULT_TELEMETRY,
        "TELEMETRY",
    ),
)


@frozen_dataclass(slots=True)
class Picked:
    """One component a scope picks: kind, name, where its options live, what picked it."""

    kind: str
    name: str
    options_path: Loc
    chooser: str
    """``KEY=value`` of the key that picked it, or ``the default <name>``."""
    env_prefix: str | None
    """``{SCOPE}__{GROUP}`` for its ``{SCOPE}__{GROUP}__{OPTION}`` keys, if it has any."""


def backend_names(value: object) -> tuple[str, ...]:
    """The names a backend value spells: one name, a ``,``-separated list (an env value) or
    a list (the pipeline file), blanks dropped. Only telemetry accepts more than one."""
    parts = value if isinstance(value, list | tuple) else str(value).split(",")
    return tuple(name for name in (str(part).strip() for part in parts) if name)


def fanout_problems(scope: str, resolved: Resolved) -> list[str]:
    """What is wrong with a list of telemetry backends (repeated names, ``none`` in a list)."""
    value = get_path(resolved.values, ("telemetry", "backend"))
    names = backend_names(value) if value is not None else ()
    if len(names) < 2:
        return []
    key = resolved.keys.get(("telemetry", "backend"), f"[scopes.{scope}.telemetry].backend")
    problems: list[str] = []
    if NO_BACKEND in names:
        problems.append(
            f"{key}: {NO_BACKEND!r} switches telemetry off and cannot be one of several "
            f"backends {list(names)}"
        )
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        problems.append(f"{key}: telemetry backends named more than once: {repeated}")
    return problems


def picked_components(scope: str, resolved: Resolved) -> list[Picked]:
    """Every component the merged values pick (switched-off cache/telemetry left out).

    A list of telemetry backends (a fan-out) picks each of them; each one's options are then
    ``[scopes.S.telemetry.options.<name>]`` (env ``{S}__TELEMETRY__<NAME>__<OPTION>``)."""
    picked: list[Picked] = []
    for slot in SLOTS:
        value = get_path(resolved.values, slot.name_path)
        key = resolved.keys.get(slot.name_path)
        if slot.kind == "telemetry" and value is not None:
            names = backend_names(value)
            if len(names) > 1:
                picked.extend(
                    Picked(
                        slot.kind,
                        name,
                        (*slot.options_path, name),
                        f"{key or 'the telemetry backend list'} naming {name!r}",
                        f"{scope}__{slot.env_group}__{name.upper()}",
                    )
                    for name in names
                    if name != NO_BACKEND
                )
                continue
            value = names[0] if names else None
        name = str(value) if value is not None else slot.default
        if name == NO_BACKEND and slot.kind in ("cache", "telemetry"):
            continue
        chooser = f"{key}={name}" if key else f"the default {name}"
        picked.append(
            Picked(slot.kind, name, slot.options_path, chooser, f"{scope}__{slot.env_group}")
        )
    layers = resolved.values.get("middleware")
    key = resolved.keys.get(("middleware",))
    for layer in layers if isinstance(layers, list) else DEFAULT_MIDDLEWARE:
        chooser = f"{key} naming {layer!r}" if key else f"the default middleware {layer!r}"
        picked.append(
            Picked("middleware", str(layer), ("middleware_options", str(layer)), chooser, None)
        )
    return picked


def _declared_of(
    registry: OptionsRegistry, kind: str, name: str
) -> type[BaseModel] | OptionsRef | None:
    # An unknown name has no model; naming it is the registry check's job.
    return registry.declared_options(kind, name) if name in registry.names(kind) else None


def _read_plain(
    declared: Sequence[tuple[Picked, type[BaseModel] | OptionsRef]],
    resolved: Resolved,
    env: Mapping[str, str],
) -> dict[Loc, Any] | None:
    """Every picked component's plain value, or ``None`` unless each reader is sure (no flat
    key set: those and ``_env`` indirections are the full path's)."""
    from polygateway.options import OptionsRef

    values: dict[Loc, Any] = {}
    for picked, options in declared:
        if not isinstance(options, OptionsRef) or options.read_plain is None:
            return None
        if any(env.get(key, "").strip() for key in options.env_keys.values()):
            return None
        raw = get_path(resolved.values, picked.options_path)
        if raw is not None and not isinstance(raw, Mapping):
            return None
        value = options.read_plain(raw or {})
        if value is None:
            return None
        values[picked.options_path] = value
    return values


def _fallback_label(scope: str, picked: Picked) -> Callable[[Loc], str]:
    """The keys that would set an option nobody set (for a missing required one)."""
    table = ".".join(map(str, picked.options_path))

    def label(loc: Loc) -> str:
        option = ".".join(map(str, loc))
        file_key = f"[scopes.{scope}.{table}].{option}"
        if picked.env_prefix is None or len(loc) != 1:
            return f"file: {file_key}"
        return f"{picked.env_prefix}__{str(loc[0]).upper()} (file: {file_key})"

    return label


@value_methods
@dataclass(repr=False, eq=False)
class ResolvedOptions:
    """What ``resolve`` produces for one scope."""

    resolved: Resolved
    """The merged values again, with the models' flat keys and ``_env`` indirections in."""
    models: dict[Loc, Any]
    """Options path -> the validated instance (or a reference's plain value), for every picked
    component with a model."""
    problems: list[str]


def resolve(
    scope: str,
    layers: Sequence[Layer],
    flat_index: int,
    resolved: Resolved,
    registry: OptionsRegistry,
    env: Mapping[str, str],
) -> ResolvedOptions:
    """Collect and validate the options of every picked component that has a model.

    :param layers: the scope's layers, lowest precedence first, as ``resolved`` was merged.
    :param flat_index: the position of the flat env layer (the models' flat keys rank with it).
    """
    declared = [
        (picked, options)
        for picked in picked_components(scope, resolved)
        if (options := _declared_of(registry, picked.kind, picked.name)) is not None
    ]
    if not declared:
        return ResolvedOptions(resolved, {}, [])
    plain = _read_plain(declared, resolved, env)
    if plain is not None:
        return ResolvedOptions(resolved, plain, [])
    with_models = [
        (picked, model)
        for picked, _ in declared
        if (model := registry.options_of(picked.kind, picked.name)) is not None
    ]
    from pydantic import ValidationError

    from polygateway.options import env_keys

    problems: list[str] = []
    pairs = [
        (
            (*picked.options_path, option),
            (*picked.options_path, f"{option}_env"),
        )
        for picked, model in with_models
        for option in _fields(model)
        if f"{option}_env" not in _fields(model)
    ]
    rebuilt: list[Layer] = []
    for layer in layers:
        data, label, found = with_env_refs(copy.deepcopy(layer.data), layer.label, env, pairs)
        problems.extend(found)
        rebuilt.append(Layer(data, label))
    rebuilt.insert(flat_index + 1, _flat_layer(with_models, env))
    merged = resolve_layers(rebuilt)

    models: dict[Loc, Any] = {}
    missing: dict[tuple[str, str, str], list[str]] = {}
    for picked, model in with_models:
        raw = get_path(merged.values, picked.options_path)
        fallback = _fallback_label(scope, picked)
        flat = env_keys(model)

        def label(
            loc: Loc, picked: Picked = picked, fallback: Callable[[Loc], str] = fallback
        ) -> str:
            found = merged.keys.get((*picked.options_path, *loc))
            return found if found is not None else fallback(loc)

        try:
            models[picked.options_path] = model.model_validate(
                dict(raw) if isinstance(raw, Mapping) else {}
            )
        except ValidationError as exc:
            from polygateway.config.layer_models import describe_error

            for error in exc.errors(include_url=False):
                loc: Loc = tuple(error["loc"])
                if error["type"] == "missing" and len(loc) == 1:
                    option = str(loc[0])
                    key = flat.get(option) or fallback(loc)
                    missing.setdefault((key, picked.chooser, picked.name), []).append(picked.kind)
                else:
                    problems.append(describe_error(error, model, label))
    problems.extend(
        f"{key}: required because {chooser} selects {name} for the {', '.join(kinds)}"
        for (key, chooser, name), kinds in missing.items()
    )
    return ResolvedOptions(merged, models, problems)


def _fields(model: type[BaseModel]) -> list[str]:
    return [info.alias or name for name, info in model.model_fields.items()]


def _flat_layer(
    with_models: Sequence[tuple[Picked, type[BaseModel]]], env: Mapping[str, str]
) -> Layer:
    """The models' flat env keys (``REDIS_URL``) as one layer, for the picked components."""
    from polygateway.options import env_keys

    data: dict[str, Any] = {}
    keys: dict[Loc, str] = {}
    for picked, model in with_models:
        for option, key in env_keys(model).items():
            value = env.get(key, "").strip()
            if not value:
                continue
            node = data
            for part in picked.options_path:
                node = node.setdefault(str(part), {})
            node[option] = value
            keys[(*picked.options_path, option)] = key

    def label(loc: Loc) -> str:
        return keys.get(loc) or ".".join(map(str, loc))

    return Layer(data, label)


def flat_key_problems(registry: OptionsRegistry, env: Mapping[str, str]) -> list[str]:
    """Every flat env key a model declares that is set, checked alone (the user wrote it,
    whether or not a scope picks the component)."""
    problems: list[str] = []
    for kind, name, flat in registry.flat_env_keys():
        for option, key in flat.items():
            value = env.get(key, "").strip()
            if not value:
                continue
            model = registry.options_of(kind, name)
            if model is None:
                continue
            from pydantic import ValidationError

            try:
                model.model_validate({option: value})
            except ValidationError as exc:
                from polygateway.config.layer_models import describe_error

                problems.extend(
                    describe_error(error, model, _constant(key))
                    for error in exc.errors(include_url=False)
                    if tuple(error["loc"])[:1] == (option,)
                )
    return list(dict.fromkeys(problems))


def _constant(key: str) -> Callable[[Loc], str]:
    def label(loc: Loc) -> str:
        return key

    return label
