"""Env key families: sources, scope settings, flat keys, .env, bad values, missing keys."""

from __future__ import annotations

from pathlib import Path

import pytest
from config_testlib import one_problem_with, problems_of, source_env
from polygateway import GatewayClient
from polygateway.config import load_scope, load_settings, plugin_filter, read_env
from polygateway.errors import ConfigError
from polygateway.transports.engine_options import EngineOptions, engine_options


def test_sources_are_aggregated_from_env_keys() -> None:
    env = {
        **source_env(
            "LLM",
            "QWEN",
            1,
            API_KEY="sk-a",
            TIMEOUT_S="90",
            CONNECT_TIMEOUT_S="5",
            TTFT_TIMEOUT_S="20",
            INTER_TOKEN_TIMEOUT_S="10",
            MAX_CONCURRENCY="4",
            RPM="60",
            TPM="10000",
            EST_TOKENS="500",
            ENABLE_THINKING="yes",
            MISSING_DONE="salvage",
            ENGINE="httpx",
            TRUST_ENV="0",
        ),
        **source_env("LLM", "QWEN", 2, TIMEOUT="30"),
        **source_env("LLM", "QWEN", 10),
        **source_env("LLM", "DEEPSEEK", 1),
    }
    scope = load_scope("LLM", env)
    assert [s.name for s in scope.sources] == ["deepseek-1", "qwen-1", "qwen-2", "qwen-10"]
    qwen = scope.source("qwen-1")
    assert qwen.provider == "qwen"
    assert qwen.scope == "LLM"
    assert qwen.base_url == "http://127.0.0.1:8400/qwen1/v1"
    assert qwen.model == "qwen-model"
    assert qwen.api_key.reveal() == "sk-a"
    assert (qwen.timeout_s, qwen.connect_timeout_s) == (90.0, 5.0)
    assert (qwen.ttft_timeout_s, qwen.inter_token_timeout_s) == (20.0, 10.0)
    assert (qwen.limits.max_concurrency, qwen.limits.rpm, qwen.limits.tpm) == (4, 60, 10000)
    assert qwen.est_tokens == 500
    assert qwen.enable_thinking is True
    assert qwen.missing_done == "salvage"
    assert qwen.transport == "openai-compat"
    assert dict(qwen.options) == {"engine": "httpx", "trust_env": False}
    # TIMEOUT is an alias of TIMEOUT_S; unset fields keep the settings defaults.
    assert scope.source("qwen-2").timeout_s == 30.0
    assert scope.source("qwen-2").enable_thinking is None
    assert not scope.source("qwen-2").api_key


def test_scopes_are_discovered_from_keys_and_reserved_segments_are_not_providers() -> None:
    env = {
        **source_env("LLM"),
        **source_env("VL_JUDGE", "OPENAI", 1),
        "LLM__RETRY__MAX_ATTEMPTS": "4",
        "LLM__BREAKER__FAIL_THRESHOLD": "7",
        "LLM__BREAKER__COOLDOWN_S": "12",
        "LLM__BREAKER__PROBE_TTL_S": "300",
        "LLM__BACKPRESSURE__STALL_WINDOW_S": "200",
        "LLM__BACKPRESSURE__QUOTA_FULL": "fail_fast",
        "LLM__BACKPRESSURE__POLL_INTERVAL_S": "0.25",
        "LLM__BACKPRESSURE__LEASE_TTL_S": "400",
        "LLM__GLOBAL__MAX_CONCURRENCY": "32",
        "LLM__GLOBAL__RPM": "100",
        "LLM__GLOBAL__TPM": "0",
        "LLM__SELECTOR": "least_inflight",
        "LLM__STRUCTURED__MAX_RETRIES": "0",
        "LLM__STRUCTURED__STRATEGY": "auto",
        "LLM__CACHE__BACKEND": "none",
        "LLM__TELEMETRY__BACKEND": "none",
    }
    settings = load_settings(env)
    assert set(settings.scopes) == {"LLM", "VL_JUDGE"}
    llm = settings.scope("LLM")
    assert [s.name for s in llm.sources] == ["qwen-1"]  # no "retry-..." or "global-..." source
    assert llm.retry.max_attempts == 4
    assert (llm.breaker.fail_threshold, llm.breaker.cooldown_s) == (7, 12.0)
    assert llm.probe_ttl_s == 300.0
    assert llm.backpressure.quota_full == "fail_fast"
    assert (llm.backpressure.stall_window_s, llm.backpressure.poll_interval_s) == (200.0, 0.25)
    assert llm.lease_ttl_s == 400.0
    assert (llm.global_limits.max_concurrency, llm.global_limits.rpm) == (32, 100)
    assert llm.selector == "least_inflight"
    assert (llm.structured_strategy, llm.max_structured_retries) == ("auto", 0)
    assert (llm.cache.backend, llm.telemetry.backend) == ("none", "none")
    # The other scope keeps the defaults: scope keys do not leak across scopes.
    vl = settings.scope("VL_JUDGE")
    assert vl.retry.max_attempts == 3
    assert vl.source("openai-1").provider == "openai"


def test_scope_keys_beat_flat_keys_and_flat_keys_apply_to_every_scope() -> None:
    env = {
        **source_env("LLM", TIMEOUT_S="45"),
        **source_env("LLM", "DEEPSEEK", 1),
        **source_env("VL"),
        "LLM_TIMEOUT": "60",
        "LLM_TTFT_TIMEOUT": "20",
        "LLM_INTER_TOKEN_TIMEOUT": "5",
        "LLM_MAX_RETRIES": "2",
        "LLM_RETRY_BASE_DELAY": "0.1",
        "LLM_RETRY_MAX_DELAY": "2",
        "LLM_CIRCUIT_BREAKER_THRESHOLD": "9",
        "LLM_CIRCUIT_BREAKER_COOLDOWN": "15",
        "PGW_QUOTA_FULL": "fail_fast",
        "LLM__RETRY__MAX_ATTEMPTS": "6",
        "VL__BREAKER__FAIL_THRESHOLD": "3",
        "VL__BACKPRESSURE__QUOTA_FULL": "wait",
    }
    settings = load_settings(env)
    llm, vl = settings.scope("LLM"), settings.scope("VL")
    assert llm.retry.max_attempts == 6  # scope key wins
    assert vl.retry.max_attempts == 2  # flat key applies to the other scope
    assert llm.retry.base_delay_s == vl.retry.base_delay_s == 0.1
    assert llm.retry.max_delay_s == 2.0
    assert llm.breaker.fail_threshold == 9
    assert vl.breaker.fail_threshold == 3
    assert vl.breaker.cooldown_s == 15.0
    assert llm.backpressure.quota_full == "fail_fast"
    assert vl.backpressure.quota_full == "wait"
    # LLM_TIMEOUT is the default source timeout; a source's own key wins.
    assert llm.source("qwen-1").timeout_s == 45.0
    assert llm.source("deepseek-1").timeout_s == 60.0
    assert vl.source("qwen-1").timeout_s == 60.0
    assert (vl.source("qwen-1").ttft_timeout_s, vl.source("qwen-1").inter_token_timeout_s) == (
        20.0,
        5.0,
    )


def test_missing_required_source_keys_are_named() -> None:
    env = {"LLM__QWEN__1__API_KEY": "sk-secret-value", "LLM__QWEN__1__RPM": "10"}
    with pytest.raises(ConfigError) as excinfo:
        load_settings(env)
    problems = problems_of(excinfo)
    assert one_problem_with(problems, "LLM__QWEN__1__BASE_URL", "required")
    assert one_problem_with(problems, "LLM__QWEN__1__MODEL", "required")
    assert not any("sk-secret-value" in p for p in problems)


def test_scope_without_sources_names_the_expected_keys() -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_scope("LLM", {})
    line = one_problem_with(problems_of(excinfo), "LLM__<PROVIDER>__<N>__BASE_URL")
    assert "LLM__<PROVIDER>__<N>__MODEL" in line
    with pytest.raises(ConfigError) as excinfo:
        load_scope("OCR", source_env("LLM"))
    assert one_problem_with(problems_of(excinfo), "OCR__<PROVIDER>__<N>__BASE_URL")
    # Scope settings alone make a scope without sources: kept by load_settings, refused here.
    env = {**source_env("LLM"), "OCR__RETRY__MAX_ATTEMPTS": "2"}
    assert load_settings(env).scope("OCR").sources == ()
    with pytest.raises(ConfigError, match="OCR: no sources configured"):
        load_scope("OCR", env)


@pytest.mark.parametrize(
    ("key", "value", "reason"),
    [
        ("LLM__QWEN__1__TIMEOUT_S", "abc", "must be a number"),
        ("LLM__QWEN__1__TIMEOUT_S", "-3", "must be > 0"),
        ("LLM__QWEN__1__TIMEOUT_S", "0", "must be > 0"),
        ("LLM__QWEN__1__TIMEOUT_S", "inf", "finite"),
        ("LLM__QWEN__1__TIMEOUT_S", "nan", "finite"),
        ("LLM__QWEN__1__RPM", "-1", "must be >= 0"),
        ("LLM__QWEN__1__RPM", "1.5", "must be an integer"),
        ("LLM__QWEN__1__MAX_CONCURRENCY", "many", "must be an integer"),
        ("LLM__QWEN__1__EST_TOKENS", "0", "must be >= 1"),
        ("LLM__QWEN__1__ENABLE_THINKING", "maybe", "true or false"),
        ("LLM__QWEN__1__TRUST_ENV", "sometimes", "true or false"),
        ("LLM__QWEN__1__MISSING_DONE", "ignore", "'retry' or 'salvage'"),
        ("LLM__QWEN__1__MAX_RESPONSE_BYTES", "-1", "must be >= 0"),
        ("LLM__QWEN__1__MAX_RESPONSE_BYTES", "lots", "must be an integer"),
        ("LLM__QWEN__1__ENGINE", "curl", "'httpx-aiohttp', 'httpx2' or 'httptools'"),
        ("LLM__QWEN__1__BASE_URL", "ftp://example.com", "http:// or https://"),
        ("LLM__QWEN__1__BASE_URL", "not a url", "http:// or https://"),
        ("LLM__RETRY__MAX_ATTEMPTS", "0", "must be >= 1"),
        ("LLM__RETRY__BASE_DELAY_S", "-1", "must be >= 0"),
        ("LLM__BREAKER__COOLDOWN_S", "0", "must be > 0"),
        ("LLM__BACKPRESSURE__QUOTA_FULL", "block", "'wait' or 'fail_fast'"),
        ("LLM__GLOBAL__TPM", "-5", "must be >= 0"),
        ("LLM__BATCH_SIZE", "0", "must be >= 1"),
        ("LLM__STRUCTURED__MAX_RETRIES", "-1", "must be >= 0"),
        ("LLM_MAX_RETRIES", "three", "must be an integer"),
        ("LLM_TIMEOUT", "-1", "must be > 0"),
        ("PGW_QUOTA_FULL", "later", "'wait' or 'fail_fast'"),
        ("PGW_CACHE_TTL_S", "0", "must be > 0"),
    ],
)
def test_bad_values_name_the_key_the_reason_and_the_value(
    key: str, value: str, reason: str
) -> None:
    env = {**source_env("LLM"), key: value}
    with pytest.raises(ConfigError) as excinfo:
        load_settings(env)
    line = one_problem_with(problems_of(excinfo), f"{key}:", reason)
    assert repr(value) in line
    # One line per problem: never pydantic's multi-line rendering.
    assert all("\n" not in p and "pydantic" not in p for p in problems_of(excinfo))


def test_every_problem_is_reported_at_once() -> None:
    env = {
        **source_env("LLM", TIMEOUT_S="x", RPM="-2"),
        "LLM__RETRY__MAX_ATTEMPTS": "zero",
        "PGW_QUOTA_FULL": "later",
    }
    with pytest.raises(ConfigError) as excinfo:
        load_settings(env)
    keys = {p.split(":", 1)[0] for p in problems_of(excinfo)}
    assert keys == {
        "LLM__QWEN__1__TIMEOUT_S",
        "LLM__QWEN__1__RPM",
        "LLM__RETRY__MAX_ATTEMPTS",
        "PGW_QUOTA_FULL",
    }


def test_unknown_source_field_lists_the_allowed_fields() -> None:
    env = {**source_env("LLM"), "LLM__QWEN__1__TIMOUT_S": "30"}
    with pytest.raises(ConfigError) as excinfo:
        load_settings(env)
    line = one_problem_with(problems_of(excinfo), "LLM__QWEN__1__TIMOUT_S", "unknown source field")
    for allowed in ("BASE_URL", "API_KEY", "MODEL", "TIMEOUT_S", "TTFT_TIMEOUT_S", "TRUST_ENV"):
        assert allowed in line


@pytest.mark.parametrize(
    ("key", "needle"),
    [
        (
            "LLM__RETRY__MAX_ATTEMTPS",
            "allowed: BASE_DELAY_S, CALL_DEADLINE_S, MAX_ATTEMPTS, MAX_DELAY_S",
        ),
        ("LLM__RETRY", "missing the field"),
        ("LLM__RETRY__1__MODEL", "RETRY is reserved"),
        ("LLM__GLOBAL__1__BASE_URL", "GLOBAL is reserved"),
        ("LLM__QWEN__BASE_URL", "not a PolyGateway key"),
        ("LLM__QWEN__ONE__MODEL", "must be an integer"),
        ("LLM__SELECTOR__NAME", "takes no field"),
    ],
)
def test_malformed_keys_of_a_configured_scope_are_problems(key: str, needle: str) -> None:
    env = {**source_env("LLM"), key: "1"}
    with pytest.raises(ConfigError) as excinfo:
        load_settings(env)
    assert one_problem_with(problems_of(excinfo), f"{key}:", needle)


def test_keys_of_other_tools_are_ignored_and_empty_values_are_unset() -> None:
    env = {
        **source_env("LLM"),
        "DOCKER__HOST__PORT": "1",
        "__PYVENV_LAUNCHER__": "x",
        "some__lower__1__key": "x",
        "PGW_REQUIRE_SERVICES": "1",
        "LLM__QWEN__1__RPM": "",
        "LLM_TIMEOUT": "  ",
    }
    settings = load_settings(env)
    assert set(settings.scopes) == {"LLM"}
    source = settings.scope("LLM").source("qwen-1")
    assert source.limits.rpm == 0
    assert source.timeout_s == 120.0


def test_timeout_and_its_alias_together_are_a_problem() -> None:
    env = {**source_env("LLM", TIMEOUT="30", TIMEOUT_S="40")}
    with pytest.raises(ConfigError, match="set only one of LLM__QWEN__1__TIMEOUT_S"):
        load_settings(env)


def test_dotenv_file_is_read_and_the_explicit_env_wins(tmp_path: Path) -> None:
    dotenv = tmp_path / "custom.env"
    dotenv.write_text(
        "LLM__QWEN__1__BASE_URL=http://127.0.0.1:8400/v1\n"
        "LLM__QWEN__1__MODEL=from-dotenv\n"
        "LLM__QWEN__1__API_KEY='sk-dotenv'\n"
        "LLM_MAX_RETRIES=4  # inline comment\n",
        encoding="utf-8",
    )
    scope = load_scope("LLM", {"LLM__QWEN__1__MODEL": "from-env"}, dotenv_path=dotenv)
    assert scope.source("qwen-1").model == "from-env"
    assert scope.source("qwen-1").api_key.reveal() == "sk-dotenv"
    assert scope.retry.max_attempts == 4
    # An explicit env without dotenv_path does not read ./.env.
    with pytest.raises(ConfigError):
        load_scope("LLM", {}, pipeline_path=None)


def test_env_none_reads_os_environ_over_dotenv_in_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / ".env").write_text(
        "PGWTEST__QWEN__1__BASE_URL=http://127.0.0.1:8400/v1\n"
        "PGWTEST__QWEN__1__MODEL=from-dotenv\n"
        "PGWTEST__RETRY__MAX_ATTEMPTS=5\n",
        encoding="utf-8",
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PGWTEST__QWEN__1__MODEL", "from-os-environ")
    values = read_env()
    assert values["PGWTEST__QWEN__1__MODEL"] == "from-os-environ"
    scope = load_scope("PGWTEST")
    assert scope.source("qwen-1").model == "from-os-environ"
    assert scope.retry.max_attempts == 5
    import os

    assert "PGWTEST__RETRY__MAX_ATTEMPTS" not in os.environ  # .env never modifies os.environ


def test_missing_dotenv_path_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="dotenv_path: file not found"):
        load_settings({}, dotenv_path=tmp_path / "nope.env")


def test_plugin_filter() -> None:
    assert plugin_filter({}) is None
    assert plugin_filter({"PGW_PLUGINS": ""}) == []
    assert plugin_filter({"PGW_PLUGINS": " pgw-redis, ,pgw-postgres "}) == [
        "pgw-redis",
        "pgw-postgres",
    ]


def test_load_scope_ignores_problems_of_other_scopes() -> None:
    env = {**source_env("LLM"), **source_env("VL", TIMEOUT_S="oops")}
    assert load_scope("LLM", env).source("qwen-1").model == "qwen-model"
    with pytest.raises(ConfigError, match="VL__QWEN__1__TIMEOUT_S"):
        load_scope("vl", env)
    with pytest.raises(ConfigError, match="VL__QWEN__1__TIMEOUT_S"):
        load_settings(env)


def test_embedding_scope_requires_batch_size() -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_settings(source_env("EMBED", "OPENAI"))
    assert one_problem_with(problems_of(excinfo), "EMBED__BATCH_SIZE", "required")
    env = {**source_env("EMBED", "OPENAI"), "EMBED__BATCH_SIZE": "64"}
    assert load_scope("EMBED", env).batch_size == 64


def test_batch_concurrency_defaults_to_serial_and_is_validated() -> None:
    env = {**source_env("EMBED", "OPENAI"), "EMBED__BATCH_SIZE": "64"}
    assert load_scope("EMBED", env).batch_concurrency == 1
    assert load_scope("EMBED", {**env, "EMBED__BATCH_CONCURRENCY": "4"}).batch_concurrency == 4
    with pytest.raises(ConfigError) as excinfo:
        load_settings({**env, "EMBED__BATCH_CONCURRENCY": "0"})
    assert one_problem_with(problems_of(excinfo), "EMBED__BATCH_CONCURRENCY", "must be >= 1")


def test_retry_max_delay_below_base_delay_is_a_problem() -> None:
    env = {**source_env("LLM"), "LLM__RETRY__BASE_DELAY_S": "5", "LLM__RETRY__MAX_DELAY_S": "1"}
    with pytest.raises(ConfigError) as excinfo:
        load_settings(env)
    assert one_problem_with(problems_of(excinfo), "LLM__RETRY__MAX_DELAY_S", "base_delay_s")


def test_max_response_bytes_per_source_and_for_every_source() -> None:
    env = {
        **source_env("LLM", "QWEN", 1, MAX_RESPONSE_BYTES="1048576"),
        **source_env("LLM", "QWEN", 2),
    }
    first, second = load_scope("LLM", env).sources
    assert (first.max_response_bytes, second.max_response_bytes) == (1048576, 64 * 1024 * 1024)
    off = load_scope("LLM", source_env("LLM", "QWEN", 1, MAX_RESPONSE_BYTES="0")).sources[0]
    assert off.max_response_bytes == 0  # 0 = no cap


def test_engine_pool_and_read_timeout_are_source_fields_kept_as_transport_options() -> None:
    env = source_env("LLM", "QWEN", 1, KEEPALIVE_S="30", MAX_CONNECTIONS="8", READ_TIMEOUT_S="2.5")
    qwen = load_scope("LLM", env).source("qwen-1")
    assert dict(qwen.options) == {
        "keepalive_s": "30",
        "max_connections": "8",
        "read_timeout_s": "2.5",
    }
    # The whole configuration (``pgw config check``) reads them too.
    assert dict(load_settings(env).scope("LLM").source("qwen-1").options) == dict(qwen.options)


ENGINE_FIELDS_BAD = {
    # A misplaced key as the value: the problem says what is wrong, never shows it.
    "KEEPALIVE_S": ("sk-misplaced-0123456789abcdef", "must be a number of seconds"),
    "READ_TIMEOUT_S": ("-1", "or off (0) for no read timeout"),
    "MAX_CONNECTIONS": ("8.5", "must be an integer >= 0"),
}


@pytest.mark.parametrize("field", sorted(ENGINE_FIELDS_BAD))
def test_a_bad_engine_source_field_is_a_problem_at_load_naming_its_key(field: str) -> None:
    value, problem = ENGINE_FIELDS_BAD[field]
    # The other engine fields set well: each option is named by its own key, not the first's.
    good = {"KEEPALIVE_S": "15s", "READ_TIMEOUT_S": "off", "MAX_CONNECTIONS": "8"}
    env = source_env("LLM", "QWEN", 1, **{**good, field: value})
    loads = (load_settings, lambda e: load_scope("LLM", e), lambda e: GatewayClient.from_env(env=e))
    for load in loads:
        with pytest.raises(ConfigError) as excinfo:
            load(env)
        [line] = problems_of(excinfo)
        assert line.startswith(f"LLM__QWEN__1__{field}: ") and problem in line
        assert value not in str(excinfo.value)


def test_engine_source_fields_take_durations_and_off() -> None:
    env = source_env(
        "LLM", "QWEN", 1, KEEPALIVE_S="1m", READ_TIMEOUT_S="500ms", MAX_CONNECTIONS="0"
    )
    env.update(source_env("LLM", "QWEN", 2, KEEPALIVE_S="0", READ_TIMEOUT_S="off"))
    env.update(source_env("LLM", "QWEN", 3, READ_TIMEOUT_S="0"))
    scope = load_scope("LLM", env)
    first, second, third = (
        engine_options(scope.source(name).options, name) for name in ("qwen-1", "qwen-2", "qwen-3")
    )
    assert first == EngineOptions(read_timeout_s=0.5, max_connections=0, keepalive_s=60.0)
    assert second == EngineOptions(read_timeout_s=None, keepalive_s=0.0)
    assert third == EngineOptions(read_timeout_s=None)  # 0 is off, as "off"


def test_engine_options_of_the_pipeline_file_are_checked_at_load_naming_the_file_key(
    tmp_path: Path,
) -> None:
    path = tmp_path / "pgw.toml"
    path.write_text(
        "[[scopes.LLM.sources]]\n"
        'provider = "qwen"\nbase_url = "http://127.0.0.1:8400/v1"\nmodel = "m"\n'
        'options = { keepalive_s = "15s", read_timeout_s = "soon" }\n',
        encoding="utf-8",
    )
    with pytest.raises(ConfigError) as excinfo:
        load_settings({}, pipeline_path=path)
    line = one_problem_with(problems_of(excinfo), "read_timeout_s", "must be a number of seconds")
    assert "keepalive_s" not in line and "scopes.LLM.sources" in line
