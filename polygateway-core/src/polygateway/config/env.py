"""The environment side of the configuration: ``.env`` reading and the env key families.

Families (ARCHITECTURE §9, M2 §1 in docs/design.md):

- sources: ``{SCOPE}__{PROVIDER}__{N}__{FIELD}``, e.g. ``LLM__QWEN__1__BASE_URL``; the source is
  named ``{provider}-{N}`` (``qwen-1``);
- scope settings: ``{SCOPE}__RETRY__MAX_ATTEMPTS``, ``{SCOPE}__GLOBAL__RPM``,
  ``{SCOPE}__SELECTOR``... (the second segment is one of ``RESERVED_SEGMENTS``, never a provider);
- component options: ``{SCOPE}__{KIND}__{OPTION}`` for the kinds of ``OPTION_GROUPS``
  (``LLM__LIMITER__SOCKET_TIMEOUT_S``): any field that is not one of the group's own is option
  ``option`` of the component the scope picks for that kind, validated by its options model;
- flat keys: ``LLM_TIMEOUT``, ``LLM_MAX_RETRIES``... (single-scope shorthand, apply to every
  scope) and the ``PGW_*`` backend choices. Plugins declare flat keys of their own for their
  options (``polygateway.options.EnvKey``); those are read by the loader, not here.

This module only sorts raw strings into layer-shaped dicts and remembers which key each value
came from; typing and constraints are ``models.py``'s job (the layer models).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from polygateway.config.kinds import CHAT_CALLS
from polygateway.config.models import Loc
from polygateway.config.suggest import closest, did_you_mean
from polygateway.errors import ConfigError
from polygateway.frozen import value_methods

SOURCE_FIELDS: dict[str, str] = {
    "BASE_URL": "base_url",
    "API_KEY": "api_key",
    "MODEL": "model",
    "TIMEOUT_S": "timeout_s",
    "TIMEOUT": "timeout_s",
    "CONNECT_TIMEOUT_S": "connect_timeout_s",
    "TTFT_TIMEOUT_S": "ttft_timeout_s",
    "INTER_TOKEN_TIMEOUT_S": "inter_token_timeout_s",
    "MAX_CONCURRENCY": "max_concurrency",
    "RPM": "rpm",
    "TPM": "tpm",
    "EST_TOKENS": "est_tokens",
    "ENABLE_THINKING": "enable_thinking",
    "MISSING_DONE": "missing_done",
    "MAX_RESPONSE_BYTES": "max_response_bytes",
    "TRANSPORT": "transport",
    "PRIORITY": "priority",
    "WEIGHT": "weight",
    "CONTEXT_WINDOW": "context_window",
    "ENGINE": "engine",
    "TRUST_ENV": "trust_env",
    "TEMPERATURE": "temperature",
    "TOP_P": "top_p",
    "MAX_TOKENS": "max_tokens",
    "SEED": "seed",
    "PRESENCE_PENALTY": "presence_penalty",
    "FREQUENCY_PENALTY": "frequency_penalty",
    "STOP": "stop",
    "USER": "user",
    "PARALLEL_TOOL_CALLS": "parallel_tool_calls",
}
"""``{SCOPE}__{PROVIDER}__{N}__{FIELD}`` -> source field (``TIMEOUT`` aliases ``TIMEOUT_S``)."""

SCOPE_GROUPS: dict[str, tuple[str, dict[str, str]]] = {
    "RETRY": (
        "retry",
        {
            "MAX_ATTEMPTS": "max_attempts",
            "BASE_DELAY_S": "base_delay_s",
            "MAX_DELAY_S": "max_delay_s",
            "SAME_SOURCE_ATTEMPTS": "same_source_attempts",
            "WAIT_RETRY_AFTER_UP_TO_S": "wait_retry_after_up_to_s",
            "MAX_RETRY_AFTER_S": "max_retry_after_s",
            "CALL_DEADLINE_S": "call_deadline_s",
            "SWITCH_ON_CONTENT_FILTER": "switch_on_content_filter",
        },
    ),
    "BREAKER": (
        "breaker",
        {
            "FAIL_THRESHOLD": "fail_threshold",
            "COOLDOWN_S": "cooldown_s",
            "PROBE_TTL_S": "probe_ttl_s",
            "MAX_COOLDOWN_S": "max_cooldown_s",
            "HEALTH_PROBE": "health_probe",
        },
    ),
    "BACKPRESSURE": (
        "backpressure",
        {
            "STALL_WINDOW_S": "stall_window_s",
            "QUOTA_FULL": "quota_full",
            "POLL_INTERVAL_S": "poll_interval_s",
            "LEASE_TTL_S": "lease_ttl_s",
        },
    ),
    "LIMITER": ("limiter", {}),
    "GLOBAL": ("global", {"MAX_CONCURRENCY": "max_concurrency", "RPM": "rpm", "TPM": "tpm"}),
    "STRUCTURED": ("structured", {"MAX_RETRIES": "max_retries", "STRATEGY": "strategy"}),
    "CACHE": ("cache", {"BACKEND": "backend", "NAMESPACE": "namespace", "TTL_S": "ttl_s"}),
    "TELEMETRY": (
        "telemetry",
        {"BACKEND": "backend", "SQLITE_PATH": "sqlite_path", "CONTENT": "content"},
    ),
}
"""``{SCOPE}__{GROUP}__{FIELD}`` -> (table, {FIELD: key})."""

OPTION_GROUPS: frozenset[str] = frozenset({"LIMITER", "BREAKER", "CACHE", "TELEMETRY"})
"""Groups whose other fields are options of the picked component (``table.options.field``)."""

SCOPE_SCALARS: dict[str, str] = {
    "SELECTOR": "selector",
    "BATCH_SIZE": "batch_size",
    "BATCH_CONCURRENCY": "batch_concurrency",
}
"""``{SCOPE}__{KEY}`` -> scope key."""

RESERVED_SEGMENTS: frozenset[str] = frozenset(SCOPE_GROUPS) | frozenset(SCOPE_SCALARS)
"""Second segments that name scope settings, never a provider."""

FLAT_KEYS: dict[str, Loc] = {
    "LLM_TIMEOUT": ("source_defaults", "timeout_s"),
    "LLM_TTFT_TIMEOUT": ("source_defaults", "ttft_timeout_s"),
    "LLM_INTER_TOKEN_TIMEOUT": ("source_defaults", "inter_token_timeout_s"),
    "LLM_MAX_RETRIES": ("retry", "max_attempts"),
    "LLM_RETRY_BASE_DELAY": ("retry", "base_delay_s"),
    "LLM_RETRY_MAX_DELAY": ("retry", "max_delay_s"),
    "LLM_CIRCUIT_BREAKER_THRESHOLD": ("breaker", "fail_threshold"),
    "LLM_CIRCUIT_BREAKER_COOLDOWN": ("breaker", "cooldown_s"),
    "PGW_STATE_BACKEND": ("state",),
    "PGW_LIMITER_BACKEND": ("limiter", "name"),
    "PGW_BREAKER_BACKEND": ("breaker", "backend"),
    "PGW_QUOTA_FULL": ("backpressure", "quota_full"),
    "PGW_CACHE_BACKEND": ("cache", "backend"),
    "PGW_CACHE_NAMESPACE": ("cache", "namespace"),
    "PGW_CACHE_TTL_S": ("cache", "ttl_s"),
    "PGW_TELEMETRY_BACKEND": ("telemetry", "backend"),
    "PGW_TELEMETRY_SQLITE_PATH": ("telemetry", "sqlite_path"),
    "PGW_TELEMETRY_CONTENT": ("telemetry", "content"),
    "PGW_PRICING_PATH": ("pricing_path",),
}
"""Flat keys (every scope) -> layer path. Scope keys and the pipeline file's scope tables win."""

CONFIG_PATH_KEY = "PGW_CONFIG"
PLUGINS_KEY = "PGW_PLUGINS"
IGNORE_KEYS_KEY = "PGW_CONFIG_IGNORE_KEYS"
OTHER_KEYS: frozenset[str] = frozenset(
    {CONFIG_PATH_KEY, PLUGINS_KEY, IGNORE_KEYS_KEY, "PGW_REQUIRE_SERVICES"}
)
"""``PGW_*`` keys read outside ``FLAT_KEYS``: the file's path, the plugin filter, the keys
other tools own, and the test suite's switch (``tools/test.sh``); known, so never reported as
typos."""

_IGNORE_PATTERN = re.compile(r"^[A-Za-z0-9_*?]+$")
IGNORE_HINT = f"another tool's key? list it in {IGNORE_KEYS_KEY}"

_SEGMENT = re.compile(r"^[A-Z0-9]+(?:_[A-Z0-9]+)*$")
_SCOPE_NAME = re.compile(r"^[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)*$")


def read_env(
    env: Mapping[str, str] | None = None, *, dotenv_path: str | os.PathLike[str] | None = None
) -> dict[str, str]:
    """The key/value pairs the configuration is read from.

    ``env=None``: ``os.environ`` over ``.env`` (``dotenv_path``, else ``./.env`` when present);
    ``os.environ`` is never modified. An explicit ``env`` is taken as-is, over ``dotenv_path``
    only when one is given. A ``dotenv_path`` that does not exist is a ``ConfigError``.
    """
    path: Path | None = None
    if dotenv_path is not None:
        path = Path(dotenv_path)
        if not path.is_file():
            raise ConfigError(f"dotenv_path: file not found: {dotenv_path}")
    elif env is None and Path(".env").is_file():
        path = Path(".env")
    merged: dict[str, str] = {}
    if path is not None:
        from dotenv import dotenv_values

        # Interpolating ${VAR} would read os.environ even when the caller passed its own env.
        values = dotenv_values(path, interpolate=env is None)
        merged.update({k: v for k, v in values.items() if v is not None})
    merged.update(os.environ if env is None else env)
    return merged


def parse_ignore_keys(raw: str) -> tuple[list[str], list[str]]:
    """A ``PGW_CONFIG_IGNORE_KEYS`` value (comma-separated key names, ``*``/``?`` wildcards):
    the patterns and the problems (an entry that is no key name or pattern)."""
    patterns: list[str] = []
    problems: list[str] = []
    for item in (part.strip() for part in raw.split(",")):
        if not item:
            continue
        if _IGNORE_PATTERN.match(item):
            patterns.append(item)
        else:
            problems.append(
                f"{IGNORE_KEYS_KEY}: {item!r} is not a key name or pattern (letters, digits, "
                "_, and the wildcards * and ?; entries separated by commas)"
            )
    return patterns, problems


def is_ignored(key: str, patterns: Sequence[str]) -> bool:
    """Whether ``key`` is one of the keys other tools own (``PGW_CONFIG_IGNORE_KEYS``)."""
    return any(fnmatchcase(key, pattern) for pattern in patterns)


def parse_plugins(raw: str | None) -> list[str] | None:
    """A ``PGW_PLUGINS`` value: unset -> ``None`` (every plugin), empty -> ``[]`` (builtin only)."""
    if raw is None:
        return None
    return [item.strip() for item in raw.split(",") if item.strip()]


@value_methods
@dataclass(repr=False, eq=False)
class EnvSource:
    """One ``{SCOPE}__{PROVIDER}__{N}`` family: raw field values and the key each came from."""

    prefix: str
    provider: str
    name: str
    values: dict[str, Any] = field(default_factory=dict)
    """Source field -> its raw string (``options``: option name -> raw string)."""
    keys: dict[str, str] = field(default_factory=dict)
    """Source field -> env key."""
    option_keys: dict[str, str] = field(default_factory=dict)
    """Transport option (``mode``) -> the env key that set it (``OCR__MONKEY__1__MODE``)."""

    def key_for(self, source_field: str) -> str:
        return self.keys.get(source_field) or f"{self.prefix}__{source_field.upper()}"

    def option_key(self, option: str) -> str:
        return self.option_keys.get(option) or self.key_for("options")


@value_methods
@dataclass(repr=False, eq=False)
class EnvScope:
    name: str
    settings: dict[str, Any] = field(default_factory=dict)
    """ScopeCommonLayer-shaped raw strings from ``{SCOPE}__{GROUP}__{FIELD}``."""
    keys: dict[Loc, str] = field(default_factory=dict)
    sources: dict[tuple[str, str], EnvSource] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def ordered_sources(self) -> list[EnvSource]:
        """By provider, then by number as a number (``QWEN__2`` before ``QWEN__10``)."""
        return [
            self.sources[k] for k in sorted(self.sources, key=lambda k: (k[0], int(k[1]), k[1]))
        ]


@value_methods
@dataclass(repr=False, eq=False)
class EnvConfig:
    """Everything the env says, sorted by family."""

    flat: dict[str, Any] = field(default_factory=dict)
    flat_keys: dict[Loc, str] = field(default_factory=dict)
    scopes: dict[str, EnvScope] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def _set_path(target: dict[str, Any], path: Loc, value: Any) -> None:
    node = target
    for part in path[:-1]:
        node = node.setdefault(str(part), {})
    node[str(path[-1])] = value


def _allowed(names: Iterable[str]) -> str:
    return ", ".join(sorted(names))


def parse_env(
    values: Mapping[str, str],
    known_scopes: Iterable[str] = (),
    source_options: Mapping[str, Mapping[str, str]] | None = None,
    ignore: Sequence[str] = (),
) -> EnvConfig:
    """Sort the env into flat keys, scope settings and sources.

    ``source_options``: scope -> the source fields (``MODE``) its call kind reads as transport
    options (``mode``), kept in the source's ``options``.

    Keys that are not PolyGateway's are ignored, except malformed keys of a scope that is
    configured (from a source key, a scope setting key or the pipeline file): those are
    problems, so that a typo is not silently dropped. Empty values count as unset. Keys
    matching ``ignore`` (``PGW_CONFIG_IGNORE_KEYS``: other tools') are never a problem and
    configure no scope; a well-formed one of a configured scope is still read.
    """
    config = EnvConfig()
    items = sorted((k, v.strip()) for k, v in values.items() if v is not None and v.strip())

    for key, value in items:
        if key in FLAT_KEYS:
            _set_path(config.flat, FLAT_KEYS[key], value)
            config.flat_keys[FLAT_KEYS[key]] = key

    family: list[tuple[str, list[str], str]] = []
    scopes_seen = {name.upper() for name in known_scopes}
    for key, value in items:
        parts = key.split("__")
        if len(parts) < 2 or not all(_SEGMENT.match(p) for p in parts):
            continue
        if not _SCOPE_NAME.match(parts[0]):
            continue
        family.append((key, parts, value))
        if is_ignored(key, ignore):
            continue
        if (len(parts) == 4 and parts[2].isdigit()) or parts[1] in RESERVED_SEGMENTS:
            scopes_seen.add(parts[0])

    for key, parts, value in family:
        scope_name = parts[0]
        if scope_name not in scopes_seen:
            continue  # not ours: some other tool's double-underscore key
        scope = config.scopes.setdefault(scope_name, EnvScope(scope_name))
        # A scope no call kind names serves chat (as the loader builds it).
        options = (source_options or {}).get(scope_name, CHAT_CALLS.source_fields)
        before = len(scope.problems)
        _parse_scope_key(scope, key, parts, value, options)
        if is_ignored(key, ignore):
            del scope.problems[before:]
    return config


def unknown_key_problems(
    values: Mapping[str, str],
    scopes: Iterable[str],
    declared: Iterable[str] = (),
    ignore: Sequence[str] = (),
) -> list[str]:
    """Every set ``PGW_*`` key, and every ``{SCOPE}_*`` key of a configured scope, that no one
    reads: a typo (``PGW_CACHE_TTL``, ``LLM_TIMOUT``) would otherwise leave a default in place.

    Only those prefixes are checked: ``OPENAI_API_KEY`` is some other tool's unless a scope is
    named ``OPENAI``. ``declared``: the flat keys plugins' options models declare
    (``REDIS_URL``...); ``ignore``: the patterns of ``PGW_CONFIG_IGNORE_KEYS`` (other tools'
    keys under a scope's prefix, ``LLM_USER_PATH``). Keys of the ``{SCOPE}__...`` families are
    ``parse_env``'s. Each problem suggests the nearest known key.
    """
    names = sorted({scope.upper() for scope in scopes})
    known = set(FLAT_KEYS) | OTHER_KEYS | set(declared)
    problems: list[str] = []
    for key, value in sorted(values.items()):
        if key in known or value is None or not value.strip() or is_ignored(key, ignore):
            continue
        if any(key.startswith(f"{name}__") for name in names):
            continue
        owner = "PGW" if key.startswith("PGW_") else None
        owner = owner or next((n for n in names if key.startswith(f"{n}_")), None)
        if owner is None:
            continue
        own = sorted(k for k in known if k.startswith(f"{owner}_"))
        hint = did_you_mean(key, own) or did_you_mean(key, sorted(known))
        if own:
            where = f"known {owner}_* keys: {_allowed(own)}"
        else:  # a scope without flat keys of its own (only LLM_* and PGW_* are flat)
            where = (
                f"scope {owner} is set with {owner}__... keys (e.g. {owner}__RETRY__MAX_ATTEMPTS)"
            )
        problems.append(f"{key}: unknown key{hint}; {where} ({IGNORE_HINT})")
    return problems


def _parse_scope_key(
    scope: EnvScope, key: str, parts: list[str], value: str, options: Mapping[str, str]
) -> None:
    second = parts[1]
    shapes = (
        f"sources are {scope.name}__<PROVIDER>__<N>__<FIELD>, scope settings "
        f"{scope.name}__<{'|'.join(sorted(SCOPE_GROUPS))}>__<FIELD> or "
        f"{scope.name}__<{'|'.join(sorted(SCOPE_SCALARS))}>"
    )
    if len(parts) == 2:
        if second in SCOPE_SCALARS:
            path: Loc = (SCOPE_SCALARS[second],)
            _set_path(scope.settings, path, value)
            scope.keys[path] = key
        elif second in SCOPE_GROUPS:
            fields = SCOPE_GROUPS[second][1]
            choices = [_allowed(fields)] if fields else []
            if second in OPTION_GROUPS:
                choices.append(f"an option of the {second.lower()} the scope picks")
            scope.problems.append(
                f"{key}: missing the field; use {key}__<FIELD> with FIELD one of "
                + " or ".join(choices)
            )
        else:
            scope.problems.append(
                f"{key}: not a PolyGateway key{_segment_hint(parts)}; {shapes} ({IGNORE_HINT})"
            )
        return
    if len(parts) == 3:
        if second in SCOPE_GROUPS:
            table, fields = SCOPE_GROUPS[second]
            if parts[2] not in fields and second in OPTION_GROUPS:
                # An option of the picked component: its options model judges the name.
                path = (table, "options", parts[2].lower())
                _set_path(scope.settings, path, value)
                scope.keys[path] = key
                return
            if parts[2] not in fields:
                scope.problems.append(
                    f"{key}: unknown {second} field {parts[2]}"
                    f"{did_you_mean(parts[2], fields)}; allowed: {_allowed(fields)}"
                )
                return
            path = (table, fields[parts[2]])
            _set_path(scope.settings, path, value)
            scope.keys[path] = key
        elif second in SCOPE_SCALARS:
            scope.problems.append(f"{key}: {scope.name}__{second} takes no field")
        else:
            scope.problems.append(
                f"{key}: not a PolyGateway key{_segment_hint(parts)}; {shapes} ({IGNORE_HINT})"
            )
        return
    if len(parts) == 4 and second == "TELEMETRY":
        # An option of one backend of a telemetry fan-out: {SCOPE}__TELEMETRY__{NAME}__{OPTION}.
        path = ("telemetry", "options", parts[2].lower(), parts[3].lower())
        _set_path(scope.settings, path, value)
        scope.keys[path] = key
        return
    if len(parts) == 4 and second not in RESERVED_SEGMENTS and parts[2].isdigit():
        _parse_source_key(scope, key, parts, value, options)
        return
    if second in RESERVED_SEGMENTS:
        scope.problems.append(
            f"{key}: {second} is reserved for scope settings and cannot name a provider; {shapes}"
        )
    elif len(parts) == 4:
        scope.problems.append(f"{key}: the source number {parts[2]!r} must be an integer; {shapes}")
    else:
        scope.problems.append(
            f"{key}: not a PolyGateway key{_segment_hint(parts)}; {shapes} ({IGNORE_HINT})"
        )


def _segment_hint(parts: list[str]) -> str:
    """A mistyped second segment (``LLM__RETRI__MAX_ATTEMPTS``) spelled right."""
    found = closest(parts[1], RESERVED_SEGMENTS)
    return f" (did you mean {'__'.join([parts[0], found, *parts[2:]])}?)" if found else ""


def _parse_source_key(
    scope: EnvScope, key: str, parts: list[str], value: str, options: Mapping[str, str]
) -> None:
    provider, number, field_name = parts[1], parts[2], parts[3]
    source_field = SOURCE_FIELDS.get(field_name)
    if source_field is None and field_name not in options:
        fields = {**SOURCE_FIELDS, **options}
        scope.problems.append(
            f"{key}: unknown source field {field_name}"
            f"{did_you_mean(field_name, fields)}; allowed: {_allowed(fields)}"
        )
        return
    prefix = f"{scope.name}__{provider}__{number}"
    source = scope.sources.setdefault(
        (provider, number),
        EnvSource(prefix=prefix, provider=provider.lower(), name=f"{provider.lower()}-{number}"),
    )
    if source_field is None:  # a transport option of the scope's call kind
        source.values.setdefault("options", {})[options[field_name]] = value
        source.keys.setdefault("options", key)
        source.option_keys[options[field_name]] = key
        return
    if source_field in source.values:
        scope.problems.append(
            f"{key}: {source.keys[source_field]} is set too; set only one of "
            f"{prefix}__TIMEOUT_S and {prefix}__TIMEOUT"
        )
        return
    source.values[source_field] = value
    source.keys[source_field] = key
