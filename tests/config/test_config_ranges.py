"""Every numeric setting is range-checked at load time, naming the key: a value the limiter,
the timers or Redis would refuse later (``EST_TOKENS=3000000000``) never passes config."""

from __future__ import annotations

import typing
from typing import Any

import pytest
from polygateway.client import GatewayClient
from polygateway.config import load_settings
from polygateway.config.env import SCOPE_GROUPS, SCOPE_SCALARS, SOURCE_FIELDS
from polygateway.config.models import (
    BackpressureLayer,
    BreakerLayer,
    CacheLayer,
    GlobalLayer,
    LayerModel,
    RetryLayer,
    ScopeCommonLayer,
    SourceLayer,
    StructuredLayer,
    TelemetryLayer,
)
from polygateway.errors import ConfigError
from polygateway.options import MAX_COUNT, MAX_DURATION_S
from polygateway.testing import FakeUpstream, Reply
from polygateway.testing.contracts.transport import MESSAGES

GROUP_MODELS: dict[str, type[LayerModel]] = {
    "retry": RetryLayer,
    "breaker": BreakerLayer,
    "backpressure": BackpressureLayer,
    "global": GlobalLayer,
    "structured": StructuredLayer,
    "cache": CacheLayer,
    "telemetry": TelemetryLayer,
    "limiter": TelemetryLayer,  # no numeric fields of its own
}


def _numeric_kind(model: type[LayerModel], field: str) -> type | None:
    """``int`` or ``float`` when the field holds a number, else ``None``."""
    annotation: Any = model.model_fields[field].annotation
    for arg in (annotation, *typing.get_args(annotation)):
        base = typing.get_args(arg)[0] if typing.get_origin(arg) is typing.Annotated else arg
        if base in (int, float):
            return base  # type: ignore[no-any-return]
    return None


def numeric_env_keys() -> list[tuple[str, type]]:
    keys: list[tuple[str, type]] = []
    for segment, field in SOURCE_FIELDS.items():
        kind = _numeric_kind(SourceLayer, field)
        if kind is not None:
            keys.append((f"LLM__OPENAI__1__{segment}", kind))
    for group, (table, fields) in SCOPE_GROUPS.items():
        for segment, field in fields.items():
            kind = _numeric_kind(GROUP_MODELS[table], field)
            if kind is not None:
                keys.append((f"LLM__{group}__{segment}", kind))
    for segment, field in SCOPE_SCALARS.items():
        kind = _numeric_kind(ScopeCommonLayer, field)
        if kind is not None:
            keys.append((f"LLM__{segment}", kind))
    return keys


NUMERIC_KEYS = numeric_env_keys()


def source_env(**extra: str) -> dict[str, str]:
    return {
        "LLM__OPENAI__1__BASE_URL": "http://127.0.0.1:9/v1",
        "LLM__OPENAI__1__MODEL": "m",
        "LLM__OPENAI__1__API_KEY": "sk-range-test",
        **extra,
    }


def test_the_numeric_keys_are_found() -> None:
    names = {key for key, _ in NUMERIC_KEYS}
    # The fields of the issue and one of every group: the discovery itself can fail.
    assert {
        "LLM__OPENAI__1__EST_TOKENS",
        "LLM__OPENAI__1__TPM",
        "LLM__OPENAI__1__TIMEOUT_S",
        "LLM__GLOBAL__TPM",
        "LLM__RETRY__MAX_ATTEMPTS",
        "LLM__BREAKER__COOLDOWN_S",
        "LLM__BACKPRESSURE__LEASE_TTL_S",
        "LLM__CACHE__TTL_S",
        "LLM__STRUCTURED__MAX_RETRIES",
        "LLM__BATCH_SIZE",
    } <= names
    assert "LLM__OPENAI__1__MODEL" not in names


@pytest.mark.parametrize(("key", "kind"), NUMERIC_KEYS, ids=[k for k, _ in NUMERIC_KEYS])
def test_every_numeric_setting_is_range_checked(key: str, kind: type) -> None:
    too_big = str(MAX_COUNT + 1) if kind is int else f"{MAX_DURATION_S * 10:g}"
    with pytest.raises(ConfigError) as info:
        load_settings(source_env(**{key: too_big}), dotenv_path=None)
    problems = [p for p in info.value.problems if p.startswith(f"{key}:")]
    assert problems, info.value.problems
    assert "must be <=" in problems[0]
    with pytest.raises(ConfigError) as info:
        load_settings(source_env(**{key: "-1"}), dotenv_path=None)
    assert any(p.startswith(f"{key}: must be >") for p in info.value.problems)


def test_the_range_applies_to_the_file_too(tmp_path: Any) -> None:
    path = tmp_path / "pgw.toml"
    path.write_text(
        '[scopes.LLM]\n[[scopes.LLM.sources]]\nprovider = "openai"\nname = "a"\n'
        'base_url = "http://127.0.0.1:9/v1"\nmodel = "m"\napi_key = "sk-range"\n'
        "est_tokens = 3000000000\n"
    )
    with pytest.raises(ConfigError, match=r"est_tokens: must be <= 2147483647"):
        load_settings({}, pipeline_path=path, dotenv_path=None)


async def test_est_tokens_at_the_limit_calls_and_beyond_it_fails_at_load(
    fake_upstream: FakeUpstream,
) -> None:
    url = fake_upstream.base_url("a")
    with pytest.raises(ConfigError, match="LLM__OPENAI__1__EST_TOKENS: must be <= 2147483647"):
        load_settings(
            source_env(LLM__OPENAI__1__BASE_URL=url, LLM__OPENAI__1__EST_TOKENS="3000000000"),
            dotenv_path=None,
        )
    settings = load_settings(
        source_env(LLM__OPENAI__1__BASE_URL=url, LLM__OPENAI__1__EST_TOKENS=str(MAX_COUNT)),
        dotenv_path=None,
    )
    fake_upstream.set_default("a", Reply.ok("in range"))
    async with GatewayClient.from_settings(settings) as client:
        response = await client.chat(MESSAGES)
    assert response.content == "in range"
