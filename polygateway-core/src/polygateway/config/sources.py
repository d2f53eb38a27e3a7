"""Upstream sources of one scope: file entries and ``{SCOPE}__{PROVIDER}__{N}__*`` env families
merged into ``SourceConfig``s.

A file entry named ``{provider}-{N}`` (the default name of the N-th entry of that provider) and
env keys ``{SCOPE}__{PROVIDER}__{N}__*`` are the same source, so the file can describe a source
and the env supply its key.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from polygateway.config import env as envkeys
from polygateway.config import pipeline as pipefile
from polygateway.config.kinds import CHAT_CALLS, CallKind
from polygateway.config.layer_values import SOURCE
from polygateway.config.merge import Label, Resolved, merge, with_env_refs
from polygateway.config.models import Loc, MaskedOptions, validate_layer
from polygateway.frozen import value_methods
from polygateway.params import ChatParams
from polygateway.settings import Limits, Secret, SourceConfig
from polygateway.transports.engine_options import engine_option_problems

_SOURCE_ARGS = (
    "timeout_s",
    "connect_timeout_s",
    "ttft_timeout_s",
    "inter_token_timeout_s",
    "est_tokens",
    "enable_thinking",
    "missing_done",
    "max_response_bytes",
    "transport",
    "priority",
    "weight",
    "context_window",
)
_LIMIT_ARGS = ("max_concurrency", "rpm", "tpm")
_PARAM_ARGS = (
    "temperature",
    "top_p",
    "max_tokens",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "stop",
    "user",
    "parallel_tool_calls",
)


@value_methods
@dataclass(repr=False, eq=False)
class SourceDraft:
    name: str
    provider: str
    values: dict[str, Any]
    keys: dict[Loc, str]
    file_label: Label | None = None
    env_source: envkeys.EnvSource | None = None
    rejected: set[str] = field(default_factory=set)
    """Fields given with a bad value (already reported; not "required" again)."""

    def apply(self, data: Mapping[str, Any], label: Label) -> None:
        merge(self.values, self.keys, data, label)

    def key(self, name: str) -> str:
        found = self.keys.get((name,))
        if found:
            return found
        names = []
        if self.file_label is not None:
            names.append(self.file_label((name,)))
        if self.env_source is not None:
            names.append(self.env_source.key_for(name))
        return names[0] + (f" (or {names[1]})" if len(names) > 1 else "")


def source_drafts(
    scope: str,
    resolved: Resolved,
    file: pipefile.PipelineFile | None,
    file_scope: pipefile.FileScope | None,
    env_scope: envkeys.EnvScope | None,
    env: Mapping[str, str],
) -> tuple[list[SourceDraft], list[str]]:
    problems: list[str] = []
    base = resolved.table("source_defaults")
    base_keys = {
        loc[1:]: key for loc, key in resolved.keys.items() if loc[:1] == ("source_defaults",)
    }
    drafts: dict[str, SourceDraft] = {}

    if file is not None and file_scope is not None:
        per_provider: dict[str, int] = {}
        for index, entry in enumerate(file_scope.sources):
            if entry is None:
                continue
            label = _file_source_label(file, file_scope, index)
            data, found = validate_layer(entry, SOURCE, label)
            data, label, more = with_env_refs(data, label, env, [(("api_key",), ("api_key_env",))])
            problems.extend(found + more)
            rejected = set(entry) - set(data) - {"api_key_env"}
            provider = data.pop("provider", None)
            if provider is None:
                if "provider" not in entry:
                    problems.append(
                        f"{label(('provider',))}: required (the provider profile name, e.g. qwen)"
                    )
                continue
            provider = str(provider).lower()
            per_provider[provider] = per_provider.get(provider, 0) + 1
            source_name = data.pop("name", None) or f"{provider}-{per_provider[provider]}"
            if source_name in drafts:
                problems.append(
                    f"{label(('name',))}: source name {source_name!r} is already used in "
                    f"[scopes.{file_scope.table_key}]; names must be unique within a scope"
                )
                continue
            draft = SourceDraft(
                source_name,
                provider,
                copy.deepcopy(base),
                dict(base_keys),
                file_label=label,
                rejected=rejected,
            )
            draft.apply(data, label)
            drafts[source_name] = draft

    if env_scope is not None:
        for env_source in env_scope.ordered_sources():
            env_label = _env_source_label(env_source)
            data, found = validate_layer(env_source.values, SOURCE, env_label)
            problems.extend(found)
            existing = drafts.get(env_source.name)
            if existing is not None and existing.provider != env_source.provider:
                problems.append(
                    f"{env_source.prefix}__*: source {env_source.name!r} is defined in the "
                    f"pipeline file with provider {existing.provider!r}, not "
                    f"{env_source.provider!r}"
                )
                continue
            if existing is None:
                existing = drafts[env_source.name] = SourceDraft(
                    env_source.name, env_source.provider, copy.deepcopy(base), dict(base_keys)
                )
            existing.env_source = env_source
            existing.rejected |= set(env_source.values) - set(data)
            existing.apply(data, env_label)
    return list(drafts.values()), problems


def _env_source_label(source: envkeys.EnvSource) -> Label:
    def label(loc: Loc) -> str:
        if len(loc) > 1 and loc[0] == "options":
            return source.option_key(str(loc[1]))  # each option has a key of its own
        return source.key_for(str(loc[0]))

    return label


def _file_source_label(file: pipefile.PipelineFile, scope: pipefile.FileScope, index: int) -> Label:
    def label(loc: Loc) -> str:
        return file.source_key(scope, index, loc)

    return label


def build_source(
    scope: str, draft: SourceDraft, call_kind: CallKind = CHAT_CALLS
) -> tuple[SourceConfig | None, list[str]]:
    values = draft.values
    for name, default in (
        ("model", call_kind.default_model),
        ("transport", call_kind.default_transport),
    ):
        if default is not None and values.get(name) is None and name not in draft.rejected:
            values[name] = default
    problems = [
        f"{draft.key(name)}: required (source {draft.name})"
        for name in ("base_url", "model")
        if values.get(name) is None and name not in draft.rejected
    ]
    if draft.rejected & {"base_url", "model"}:
        return None, problems
    if problems:
        return None, problems
    given = values.get("options") or {}
    if call_kind.http_engine:
        problems = engine_option_problems(
            given, lambda name: draft.keys.get(("options", name)) or draft.key("options")
        )
        if problems:
            return None, problems
    options = MaskedOptions(given)
    for option in ("engine", "trust_env"):
        if option in values:
            options[option] = values[option]
    kwargs = {name: values[name] for name in _SOURCE_ARGS if name in values}
    limits = Limits(**{name: values[name] for name in _LIMIT_ARGS if name in values})
    params = {name: values[name] for name in _PARAM_ARGS if values.get(name) is not None}
    if isinstance(params.get("stop"), list):
        params["stop"] = tuple(params["stop"])
    if params:
        kwargs["params"] = ChatParams(**params)
    source = SourceConfig(
        name=draft.name,
        provider=draft.provider,
        base_url=str(values["base_url"]),
        model=str(values["model"]),
        api_key=Secret(str(values.get("api_key") or "")),
        scope=scope,
        limits=limits,
        options=options,
        **kwargs,
    )
    return source, []
