"""The plugin's options as users write them: ``REDIS_URL`` (declared by the plugin's options
model, not known to the core), per-scope option keys, the problems the loader reports and what
``pgw config check`` shows. No Redis server needed: nothing connects at load time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from polygateway.config import describe_settings, load_scope, load_settings
from polygateway.errors import ConfigError
from polygateway.plugins import load_registry

SECRET = "s3cr3t-SENTINEL-9f2c"


@pytest.fixture(autouse=True)
def _empty_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no stray ./.env or ./pgw.toml


def source_env(scope: str = "LLM") -> dict[str, str]:
    return {
        f"{scope}__QWEN__1__BASE_URL": "http://127.0.0.1:8400/qwen1/v1",
        f"{scope}__QWEN__1__MODEL": "qwen-model",
    }


def problems(env: dict[str, str], **kwargs: object) -> list[str]:
    with pytest.raises(ConfigError) as excinfo:
        load_settings(env, **kwargs)  # type: ignore[arg-type]
    return list(excinfo.value.problems)


def one_with(lines: list[str], *needles: str) -> str:
    found = [line for line in lines if all(n in line for n in needles)]
    assert found, f"no problem contains {needles}; problems: {lines}"
    return found[0]


STATE = {"PGW_STATE_BACKEND": "redis", "PGW_CACHE_NAMESPACE": "n", "PGW_CACHE_TTL_S": "60"}


def test_state_backend_redis_requires_redis_url() -> None:
    env = {**source_env(), **STATE}
    line = one_with(problems(env), "REDIS_URL: required", "PGW_STATE_BACKEND=redis")
    assert "limiter, breaker, cache" in line  # one line for the three parts it picked
    scope = load_scope("LLM", {**env, "REDIS_URL": f"redis://:{SECRET}@127.0.0.1:6379/3"})
    for options in (scope.limiter.options, scope.breaker_backend.options, scope.cache.options):
        assert options.url.reveal() == f"redis://:{SECRET}@127.0.0.1:6379/3"
    assert (scope.limiter.name, scope.breaker_backend.name, scope.cache.backend) == ("redis",) * 3
    cluster = load_scope("LLM", {**env, "REDIS_URL": "redis+cluster://127.0.0.1:7000"})
    assert cluster.limiter.options.url.reveal() == "redis+cluster://127.0.0.1:7000"


@pytest.mark.parametrize("key", ["PGW_LIMITER_BACKEND", "PGW_BREAKER_BACKEND", "PGW_CACHE_BACKEND"])
def test_each_redis_choice_requires_redis_url(key: str) -> None:
    env = {**source_env(), key: "redis", "PGW_CACHE_NAMESPACE": "n", "PGW_CACHE_TTL_S": "9"}
    assert one_with(problems(env), "REDIS_URL: required", f"{key}=redis")


def test_bad_redis_url_never_shows_its_password() -> None:
    # Checked although nothing picks Redis: the user wrote the key.
    env = {**source_env(), "REDIS_URL": f"http://:{SECRET}@127.0.0.1:6379"}
    found = problems(env)
    line = one_with(found, "REDIS_URL", "redis://")
    assert SECRET not in " ".join(found) and SECRET not in line
    # Picked three times, still one line.
    assert len([p for p in problems({**env, **STATE}) if p.startswith("REDIS_URL")]) == 1


@pytest.mark.parametrize(
    "bad", [{"REDIS_URL": f"tcp://u:{SECRET}@h"}, {"LLM__LIMITER__URL": f"ftp://:{SECRET}@h"}]
)
def test_secrets_never_appear_in_problems(bad: dict[str, str]) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_settings({**source_env(), **STATE, "REDIS_URL": "redis://h:6379/3", **bad})
    assert SECRET not in str(excinfo.value)
    # Pydantic's error (which carries inputs) is not chained into the traceback.
    assert excinfo.value.__cause__ is None and excinfo.value.__context__ is None


def test_scope_keys_and_file_options_beat_the_flat_key(tmp_path: Path) -> None:
    path = tmp_path / "pgw.toml"
    path.write_text(
        "[scopes.LLM.cache]\nnamespace = 'n'\nttl_s = 5\n"
        "[scopes.LLM.cache.options]\nprefix = 'tenant:'\nsocket_timeout_s = '500ms'\n"
        "url_env = 'CACHE_REDIS'\n",
        encoding="utf-8",
    )
    env = {
        **source_env(),
        **STATE,
        "REDIS_URL": "redis://127.0.0.1:6379/3",
        "LLM__LIMITER__URL": "redis://127.0.0.1:6379/4",
        "LLM__BREAKER__ELIDE_CLEAN_SUCCESS": "off",
        "LLM__CACHE__MAX_CONNECTIONS": "3",
        "CACHE_REDIS": "redis://127.0.0.1:6379/5",
    }
    scope = load_scope("LLM", env, pipeline_path=path)
    assert scope.cache.options.url.reveal() == "redis://127.0.0.1:6379/5"  # file's url_env
    assert scope.limiter.options.url.reveal() == "redis://127.0.0.1:6379/4"  # scope key wins
    assert scope.breaker_backend.options.url.reveal() == "redis://127.0.0.1:6379/3"
    assert scope.breaker_backend.options.elide_clean_success is False
    cache = scope.cache.options
    assert (cache.prefix, cache.socket_timeout_s, cache.max_connections) == ("tenant:", 0.5, 3)


def test_bad_options_name_the_key_the_user_wrote(tmp_path: Path) -> None:
    path = tmp_path / "pgw.toml"
    path.write_text(
        "[scopes.LLM.limiter.options]\nsockettimeout = 1\nmax_connections = 8.5\n",
        encoding="utf-8",
    )
    env = {
        **source_env(),
        **STATE,
        "REDIS_URL": "redis://127.0.0.1:6379/3",
        "LLM__BREAKER__SOCKET_TIMEOUT_S": "0",
        "LLM__BREAKER__ELIDE_CLEAN_SUCCESS": "maybe",
    }
    found = problems(env, pipeline_path=path)
    one_with(
        found,
        f"{path}:[scopes.LLM.limiter.options].sockettimeout",
        "unknown key (did you mean socket_timeout_s?); allowed",
    )
    one_with(found, f"{path}:[scopes.LLM.limiter.options].max_connections", "an integer")
    one_with(found, "LLM__BREAKER__SOCKET_TIMEOUT_S: must be > 0, got '0'")
    one_with(found, "LLM__BREAKER__ELIDE_CLEAN_SUCCESS: must be true or false", "'maybe'")


def test_the_resolved_options_show_masked(tmp_path: Path) -> None:
    env = {
        **source_env(),
        **STATE,
        "REDIS_URL": f"redis://user:{SECRET}@127.0.0.1:6379/3?password={SECRET}",
    }
    settings = load_settings(env, registry=load_registry(allowed=["pgw-redis"]))
    described = describe_settings(settings)
    assert SECRET not in json.dumps(described)
    scope = described["scopes"]["LLM"]
    assert scope["limiter"]["options"] == {
        "url": "redis://user:***@127.0.0.1:6379/3?***",
        "socket_timeout_s": 2.0,
        "connect_timeout_s": 2.0,
        "max_connections": None,
    }
    assert scope["breaker_backend"]["options"]["elide_clean_success"] is True
    assert scope["cache"]["options"]["prefix"] == ""
    assert SECRET not in repr(settings)


def test_pgw_config_check_shows_the_plugin_options(tmp_path: Path) -> None:
    env = {
        **os.environ,
        **source_env(),
        **STATE,
        "REDIS_URL": f"redis://:{SECRET}@127.0.0.1:6379/3",
        "PGW_PLUGINS": "pgw-redis",
    }
    run = subprocess.run(
        [sys.executable, "-m", "polygateway.cli", "config", "check", "--json"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr
    scope = json.loads(run.stdout)["scopes"]["LLM"]
    assert scope["limiter"]["options"]["url"] == "redis://:***@127.0.0.1:6379/3"
    assert SECRET not in run.stdout + run.stderr
