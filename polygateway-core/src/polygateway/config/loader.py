"""Resolve env, ``.env`` and the pipeline file into validated ``GatewaySettings``.

The work is split by concept: ``inputs.py`` reads the origins (env, ``.env``, the pipeline
file), ``merge.py`` merges layers by precedence (documented there), ``sources.py`` builds a
scope's upstream sources and ``scope.py`` one scope's settings.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from polygateway.config.inputs import Inputs, read_inputs
from polygateway.config.kinds import CHAT_CALLS, CallKind
from polygateway.config.scope import build_scope
from polygateway.errors import ConfigError, PluginError
from polygateway.settings import GatewaySettings, ScopeSettings

if TYPE_CHECKING:
    from polygateway.config.components import ConfigRegistry


def _scope_names(inputs: Inputs) -> list[str]:
    names = list(inputs.pipeline.scopes) if inputs.pipeline else []
    names.extend(sorted(set(inputs.env_config.scopes) - set(names)))
    return names


def _error(problems: list[str], registry: ConfigRegistry | None) -> ConfigError:
    """``PluginError`` when a problem comes from a plugin that failed to load (what
    ``from_env`` and ``pgw config check`` both raise), else ``ConfigError``."""
    lines = list(dict.fromkeys(problems))
    failures = [line for line in (registry.unavailable() if registry else ()) if "failed" in line]
    if any(failure in line for line in lines for failure in failures):
        return PluginError(lines)
    return ConfigError(lines)


def no_sources_problem(scope: str) -> str:
    return (
        f"{scope}: no sources configured; set {scope}__<PROVIDER>__<N>__BASE_URL and "
        f"{scope}__<PROVIDER>__<N>__MODEL (e.g. {scope}__QWEN__1__BASE_URL, "
        f"{scope}__QWEN__1__MODEL, {scope}__QWEN__1__API_KEY) or add [[scopes.{scope}.sources]] "
        "to the pipeline file"
    )


def load_settings(
    env: Mapping[str, str] | None = None,
    *,
    pipeline_path: str | os.PathLike[str] | None = None,
    dotenv_path: str | os.PathLike[str] | None = None,
    registry: ConfigRegistry | None = None,
    call_kinds: Mapping[str, CallKind] | None = None,
) -> GatewaySettings:
    """Every scope found in env, ``.env`` and the pipeline file, validated and guarded.

    :param env: ``None`` reads ``os.environ`` over ``.env`` (``./.env`` or ``dotenv_path``);
        a mapping is used as-is (over ``dotenv_path`` only when given).
    :param pipeline_path: the TOML pipeline file; default ``PGW_CONFIG``, else ``./pgw.toml``
        when present; no file means defaults.
    :param registry: when given, every implementation name is checked against it. Options
        models come from it, else from the installed plugins (``PGW_PLUGINS`` applies): the
        options of every picked component with a model are validated either way.
    :param call_kinds: scope name -> the call kind it serves (``CallKind``: where its sources'
        ``transport`` names are looked up, their defaults, extra source fields); scopes not
        named serve chat.
    :raises ConfigError: with one line per problem, naming the key; secrets never shown.
    """
    kinds = {k.upper(): v for k, v in (call_kinds or {}).items()}
    options = {name: kind.source_fields for name, kind in kinds.items()}
    inputs = read_inputs(env, pipeline_path, dotenv_path, registry, options)
    problems = list(inputs.problems)
    scopes: dict[str, ScopeSettings] = {}
    for name in _scope_names(inputs):
        scope, found = build_scope(name, inputs, registry, kinds.get(name, CHAT_CALLS))
        problems.extend(found)
        if scope is not None:
            scopes[name] = scope
    if problems:
        raise _error(problems, registry)
    return GatewaySettings(scopes=scopes)


def load_scope(
    scope: str = "LLM",
    env: Mapping[str, str] | None = None,
    *,
    pipeline_path: str | os.PathLike[str] | None = None,
    dotenv_path: str | os.PathLike[str] | None = None,
    registry: ConfigRegistry | None = None,
    call_kind: CallKind = CHAT_CALLS,
) -> ScopeSettings:
    """One scope's settings (same arguments as ``load_settings``; ``call_kind``: the call kind
    the scope serves, see ``CallKind``).

    Only this scope's problems (and those of shared keys) are raised: a half-configured other
    scope does not stop this one. A scope without sources is a ``ConfigError`` naming the keys
    that would define one.
    """
    name = scope.upper()
    inputs = read_inputs(env, pipeline_path, dotenv_path, registry, {name: call_kind.source_fields})
    problems = list(inputs.problems)
    built: ScopeSettings | None = None
    if name in _scope_names(inputs):
        built, found = build_scope(name, inputs, registry, call_kind)
        problems.extend(found)
        if built is not None and not built.sources:
            problems.append(no_sources_problem(name))
    else:
        problems.append(no_sources_problem(name))
    if problems or built is None:
        raise _error(problems, registry)
    return built
