"""Helpers for the configuration tests: a minimal env and a fake plugin registry."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from polygateway.errors import ConfigError

BUILTIN_NAMES: dict[str, tuple[str, ...]] = {
    "transport": ("openai-compat",),
    "provider": ("deepseek", "generic", "openai", "qwen"),
    "limiter": ("memory",),
    "breaker": ("memory",),
    "cache": ("memory",),
    "selector": ("least_inflight", "round_robin"),
    "structured": ("auto", "json-repair", "native-schema"),
    "telemetry": ("sqlite",),
    "middleware": ("cache", "retry", "structured", "telemetry"),
}


class FakeRegistry:
    """What the loader needs of ``polygateway.plugins.Registry``: names (no options models, no
    failed plugins)."""

    def __init__(self, extra: Mapping[str, Sequence[str]] | None = None) -> None:
        self._names = {kind: list(names) for kind, names in BUILTIN_NAMES.items()}
        for kind, names in (extra or {}).items():
            self._names.setdefault(kind, []).extend(names)

    def names(self, kind: str) -> list[str]:
        return sorted(self._names.get(kind, []))

    def options_of(self, kind: str, name: str) -> None:
        return None

    def declared_options(self, kind: str, name: str) -> None:
        return None

    def flat_env_keys(self) -> list[tuple[str, str, dict[str, str]]]:
        return []

    def unavailable(self) -> list[str]:
        return []


def source_env(
    scope: str = "LLM", provider: str = "QWEN", n: int = 1, **fields: str
) -> dict[str, str]:
    """Env keys of one valid source plus ``fields`` (FIELD=value)."""
    prefix = f"{scope}__{provider}__{n}"
    env = {
        f"{prefix}__BASE_URL": f"http://127.0.0.1:8400/{provider.lower()}{n}/v1",
        f"{prefix}__MODEL": f"{provider.lower()}-model",
    }
    env.update({f"{prefix}__{name}": value for name, value in fields.items()})
    return env


def problems_of(excinfo: pytest.ExceptionInfo[ConfigError]) -> list[str]:
    return list(excinfo.value.problems)


def one_problem_with(problems: Sequence[str], *needles: str) -> str:
    """The problem line containing every needle (fails listing the problems otherwise)."""
    found = [p for p in problems if all(n in p for n in needles)]
    assert found, f"no problem contains {needles}; problems: {problems}"
    return found[0]


# --------------------------------------------------------------------------- a plugin's options

_PG_SCHEMES = ("postgresql://", "postgres://")


def _pg_dsn(value: Any) -> Any:
    if not value.reveal().startswith(_PG_SCHEMES):
        raise ValueError("must be a postgresql:// URL (value not shown: it may hold a password)")
    return value


def postgres_like_registry() -> Any:
    """A registry whose ``postgres`` telemetry declares a ``dsn`` option the way a Postgres
    plugin does (flat key ``PGW_TELEMETRY_PG_DSN``, scheme checked by the plugin's model)."""
    from typing import Annotated

    from polygateway import hookimpl
    from polygateway.options import ComponentOptions, EnvKey, PositiveInt, SecretText
    from polygateway.plugins import load_registry
    from pydantic import AfterValidator

    class PostgresLikeOptions(ComponentOptions):
        dsn: Annotated[SecretText, EnvKey("PGW_TELEMETRY_PG_DSN"), AfterValidator(_pg_dsn)]
        batch_size: PositiveInt = 100

    class PostgresLike:
        @hookimpl
        def pgw_register_telemetry(self, register: Any) -> None:
            register("postgres", lambda ctx: None, options=PostgresLikeOptions)

    return load_registry(autoload=False, extra_plugins=[("pgw-postgres-like", PostgresLike())])
