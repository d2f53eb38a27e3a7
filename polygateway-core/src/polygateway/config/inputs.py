"""The configuration's origins, read once per load: env over ``.env``, the pipeline file, and
the layers every scope shares (flat env keys, the file's ``[defaults]``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from polygateway.config import env as envkeys
from polygateway.config import pipeline as pipefile
from polygateway.config.components import OptionsRegistry, flat_key_problems
from polygateway.config.layer_values import SCOPE_COMMON
from polygateway.config.merge import Layer, rejected_names
from polygateway.config.models import Loc, validate_layer
from polygateway.config.scope import GUARD_FIELDS
from polygateway.errors import ConfigError
from polygateway.frozen import value_methods


@value_methods
@dataclass(repr=False, eq=False)
class Inputs:
    """Everything read once per load, shared by every scope."""

    env: dict[str, str]
    env_config: envkeys.EnvConfig
    pipeline: pipefile.PipelineFile | None
    flat: Layer
    defaults: Layer | None
    problems: list[str]
    shared_invalid: bool
    """A shared layer had a guarded value rejected: the guards would judge a default instead."""
    registry: OptionsRegistry
    """Where options models come from: the given registry, else the installed plugins."""


def read_inputs(
    env: Mapping[str, str] | None,
    pipeline_path: str | os.PathLike[str] | None,
    dotenv_path: str | os.PathLike[str] | None,
    registry: OptionsRegistry | None = None,
    source_options: Mapping[str, Mapping[str, str]] | None = None,
) -> Inputs:
    """``source_options``: scope -> the source fields its call kind reads as transport
    options (see ``CallKind.source_options``)."""
    problems: list[str] = []
    try:
        values = envkeys.read_env(env, dotenv_path=dotenv_path)
    except ConfigError as exc:
        problems.extend(exc.problems)
        values = dict(os.environ if env is None else env)

    pipeline: pipefile.PipelineFile | None = None
    path, missing = pipefile.locate(values, pipeline_path)
    if missing:
        problems.append(missing)
    if path is not None:
        pipeline, file_problems = pipefile.read(path)
        problems.extend(file_problems)

    known = list(pipeline.scopes) if pipeline else []
    ignore, ignore_problems = _ignored_keys(values, pipeline)
    problems.extend(ignore_problems)
    env_config = envkeys.parse_env(
        values, known_scopes=known, source_options=source_options, ignore=ignore
    )
    problems.extend(env_config.problems)
    shared_problems: list[str] = []
    rejected: set[str] = set()

    flat_keys = env_config.flat_keys

    def flat_label(loc: Loc) -> str:
        return flat_keys.get(loc) or ".".join(map(str, loc))

    flat_data, flat_problems = validate_layer(env_config.flat, SCOPE_COMMON, flat_label)
    shared_problems.extend(flat_problems)
    rejected |= rejected_names(env_config.flat, flat_data)
    flat = Layer(flat_data, flat_label)

    defaults: Layer | None = None
    if pipeline is not None and pipeline.defaults is not None:
        file = pipeline

        def defaults_label(loc: Loc) -> str:
            return file.key(("defaults", *loc))

        data, found = validate_layer(pipeline.defaults, SCOPE_COMMON, defaults_label)
        shared_problems.extend(found)
        rejected |= rejected_names(pipeline.defaults, data)
        defaults = Layer(data, defaults_label)

    if registry is None:
        registry, found = installed_registry(_plugins_of(values, pipeline))
        shared_problems.extend(found)
    shared_problems.extend(flat_key_problems(registry, values))
    declared = [key for _k, _n, flat in registry.flat_env_keys() for key in flat.values()]
    configured = [*env_config.scopes, *(pipeline.scopes if pipeline else ())]
    shared_problems.extend(envkeys.unknown_key_problems(values, configured, declared, ignore))
    problems.extend(shared_problems)
    return Inputs(
        env=values,
        env_config=env_config,
        pipeline=pipeline,
        flat=flat,
        defaults=defaults,
        problems=problems,
        shared_invalid=bool(rejected & GUARD_FIELDS),
        registry=registry,
    )


def _ignored_keys(
    values: Mapping[str, str], pipeline: pipefile.PipelineFile | None
) -> tuple[list[str], list[str]]:
    """Other tools' keys: ``PGW_CONFIG_IGNORE_KEYS`` (env, then ``.env``), else the file's
    top-level ``ignore_keys``, as every other key is read. The patterns and their problems."""
    if envkeys.IGNORE_KEYS_KEY in values:
        return envkeys.parse_ignore_keys(values[envkeys.IGNORE_KEYS_KEY])
    if pipeline is None or pipeline.ignore_keys is None:
        return [], []
    patterns, problems = envkeys.parse_ignore_keys(",".join(pipeline.ignore_keys))
    label = pipeline.key(("ignore_keys",))
    return patterns, [p.replace(envkeys.IGNORE_KEYS_KEY, label, 1) for p in problems]


def _plugins_of(
    values: Mapping[str, str], pipeline: pipefile.PipelineFile | None
) -> list[str] | None:
    if envkeys.PLUGINS_KEY in values:
        return envkeys.parse_plugins(values[envkeys.PLUGINS_KEY])
    return pipeline.plugins if pipeline is not None else None


def plugin_filter(
    env: Mapping[str, str] | None = None,
    *,
    dotenv_path: str | os.PathLike[str] | None = None,
    pipeline_path: str | os.PathLike[str] | None = None,
) -> list[str] | None:
    """The plugin filter, read as the loader reads every key: ``PGW_PLUGINS`` from env, then
    ``.env``, then the pipeline file's top-level ``plugins``. ``None``: every plugin.

    ``from_env`` and every ``pgw`` command call this, so they load the same plugins. Problems
    (a missing file, bad TOML) are left to ``load_settings``, which reports them by key.
    """
    try:
        values = envkeys.read_env(env, dotenv_path=dotenv_path)
    except ConfigError:
        values = dict(os.environ if env is None else env)
    if envkeys.PLUGINS_KEY in values:
        return envkeys.parse_plugins(values[envkeys.PLUGINS_KEY])
    path, _missing = pipefile.locate(values, pipeline_path)
    pipeline = pipefile.read(path)[0] if path is not None else None
    return _plugins_of(values, pipeline)


def installed_registry(allowed: list[str] | None) -> tuple[OptionsRegistry, list[str]]:
    """The installed plugins passing the filter ``allowed``, for their options models."""
    from polygateway.plugins import Registry, load_registry

    try:
        return load_registry(allowed=allowed), []
    except ConfigError as exc:  # two plugins registering one name: nothing to look up
        return Registry({}, []), list(exc.problems)
