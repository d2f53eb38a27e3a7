"""The configuration's origins, read once per load: env over ``.env``, the pipeline file, and
the layers every scope shares (flat env keys, the file's ``[defaults]``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from polygateway.config import env as envkeys
from polygateway.config import pipeline as pipefile
from polygateway.config.components import OptionsRegistry, flat_key_problems
from polygateway.config.merge import Layer, rejected_names
from polygateway.config.models import Loc, ScopeCommonLayer, validate_layer
from polygateway.config.scope import GUARD_FIELDS
from polygateway.errors import ConfigError


@dataclass
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
) -> Inputs:
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
    env_config = envkeys.parse_env(values, known_scopes=known)
    problems.extend(env_config.problems)
    shared_problems: list[str] = []
    rejected: set[str] = set()

    flat_keys = env_config.flat_keys

    def flat_label(loc: Loc) -> str:
        return flat_keys.get(loc) or ".".join(map(str, loc))

    flat_data, flat_problems = validate_layer(env_config.flat, ScopeCommonLayer, flat_label)
    shared_problems.extend(flat_problems)
    rejected |= rejected_names(env_config.flat, flat_data)
    flat = Layer(flat_data, flat_label)

    defaults: Layer | None = None
    if pipeline is not None and pipeline.defaults is not None:
        file = pipeline

        def defaults_label(loc: Loc) -> str:
            return file.key(("defaults", *loc))

        data, found = validate_layer(pipeline.defaults, ScopeCommonLayer, defaults_label)
        shared_problems.extend(found)
        rejected |= rejected_names(pipeline.defaults, data)
        defaults = Layer(data, defaults_label)

    if registry is None:
        registry, found = installed_registry(values)
        shared_problems.extend(found)
    shared_problems.extend(flat_key_problems(registry, values))
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


def installed_registry(env: Mapping[str, str]) -> tuple[OptionsRegistry, list[str]]:
    """The installed plugins (``PGW_PLUGINS`` of ``env`` applies), for their options models."""
    from polygateway.plugins import Registry, load_registry, parse_plugin_filter

    try:
        return load_registry(allowed=parse_plugin_filter(env.get(envkeys.PLUGINS_KEY))), []
    except ConfigError as exc:  # two plugins registering one name: nothing to look up
        return Registry({}, []), list(exc.problems)
