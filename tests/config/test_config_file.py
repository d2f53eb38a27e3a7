"""The TOML pipeline file: tables, precedence against env, unknown keys, key names in problems."""

from __future__ import annotations

from pathlib import Path

import pytest
from config_testlib import one_problem_with, problems_of, source_env
from polygateway.config import load_scope, load_settings
from polygateway.errors import ConfigError

FULL = """
[defaults]
state = "memory"
selector = "least_inflight"

[defaults.cache]
namespace = "proj"
ttl_s = 600

[defaults.retry]
max_attempts = 4

[scopes.LLM]
middleware = ["telemetry", "structured", "retry"]
pricing_path = "{pricing}"

[scopes.LLM.retry]
base_delay_s = 0.2
max_delay_s = 4

[scopes.LLM.breaker]
fail_threshold = 8
cooldown_s = 20
backend = "memory"

[scopes.LLM.breaker.options]
shards = 4

[scopes.LLM.backpressure]
quota_full = "fail_fast"
stall_window_s = 120
lease_ttl_s = 200

[scopes.LLM.global]
max_concurrency = 16
rpm = 1000

[scopes.LLM.limiter]
name = "memory"

[scopes.LLM.limiter.options]
max_sources = 10

[scopes.LLM.telemetry]
backend = "sqlite"
sqlite_path = "calls.db"

[scopes.LLM.telemetry.options]
batch_size = 50

[scopes.LLM.structured]
strategy = "auto"
max_retries = 2

[scopes.LLM.source_defaults]
timeout_s = 100
ttft_timeout_s = 30

[scopes.LLM.middleware_options.telemetry]
sample = 1.0

[[scopes.LLM.sources]]
provider = "qwen"
base_url = "http://127.0.0.1:8400/a/v1"
model = "qwen-plus"
api_key_env = "QWEN_KEY"
max_concurrency = 4
engine = "httpx"

[scopes.LLM.sources.options]
read_timeout_s = 50

[[scopes.LLM.sources]]
provider = "qwen"
base_url = "http://127.0.0.1:8400/b/v1"
model = "qwen-max"
ttft_timeout_s = 40

[[scopes.LLM.sources]]
provider = "deepseek"
name = "primary"
base_url = "http://127.0.0.1:8400/c/v1"
model = "deepseek-chat"
api_key = "sk-inline"
enable_thinking = true
"""


def write(tmp_path: Path, text: str, name: str = "pgw.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def full_file(tmp_path: Path) -> Path:
    pricing = tmp_path / "pricing.json"
    pricing.write_text("{}", encoding="utf-8")
    return write(tmp_path, FULL.replace("{pricing}", str(pricing)), "full.toml")


def test_every_table_of_the_file_is_resolved(full_file: Path) -> None:
    scope = load_scope("LLM", {"QWEN_KEY": "sk-from-env"}, pipeline_path=full_file)
    assert [s.name for s in scope.sources] == ["qwen-1", "qwen-2", "primary"]
    first, second, third = scope.sources
    assert first.api_key.reveal() == "sk-from-env"
    assert first.limits.max_concurrency == 4
    assert dict(first.options) == {"read_timeout_s": 50, "engine": "httpx"}
    assert (first.timeout_s, first.ttft_timeout_s) == (100.0, 30.0)
    assert second.ttft_timeout_s == 40.0
    assert (third.provider, third.api_key.reveal(), third.enable_thinking) == (
        "deepseek",
        "sk-inline",
        True,
    )
    assert scope.middleware == ("telemetry", "structured", "retry")
    assert scope.selector == "least_inflight"
    assert scope.retry.max_attempts == 4  # from [defaults]
    assert (scope.retry.base_delay_s, scope.retry.max_delay_s) == (0.2, 4.0)
    assert (scope.breaker.fail_threshold, scope.breaker.cooldown_s) == (8, 20.0)
    assert (scope.breaker_backend.name, dict(scope.breaker_backend.options)) == (
        "memory",
        {"shards": 4},
    )
    assert (scope.limiter.name, dict(scope.limiter.options)) == ("memory", {"max_sources": 10})
    assert scope.backpressure.quota_full == "fail_fast"
    assert scope.lease_ttl_s == 200.0
    assert (scope.global_limits.max_concurrency, scope.global_limits.rpm) == (16, 1000)
    assert (scope.cache.backend, scope.cache.namespace, scope.cache.ttl_s) == (
        "memory",
        "proj",
        600,
    )
    # The sqlite recorder declares its options: validated, defaults filled in.
    assert (scope.telemetry.sqlite_path, scope.telemetry.options.batch_size) == ("calls.db", 50)
    assert scope.telemetry.options.queue_max == 100_000
    assert (scope.structured_strategy, scope.max_structured_retries) == ("auto", 2)
    assert {k: dict(v) for k, v in scope.middleware_options.items()} == {
        "telemetry": {"sample": 1.0}
    }
    assert scope.pricing_path is not None and scope.pricing_path.endswith("pricing.json")


def test_env_beats_the_file_at_the_same_level(full_file: Path) -> None:
    env = {
        "QWEN_KEY": "sk-a",
        "LLM__RETRY__BASE_DELAY_S": "0.7",
        "LLM__QWEN__1__TIMEOUT_S": "50",
        "LLM__QWEN__1__API_KEY": "sk-env-wins",
        "LLM__QWEN__2__MODEL": "qwen-turbo",
        "LLM__GLOBAL__RPM": "5",
        "PGW_LIMITER_BACKEND": "memory",
    }
    scope = load_scope("LLM", env, pipeline_path=full_file)
    assert scope.retry.base_delay_s == 0.7
    assert scope.source("qwen-1").timeout_s == 50.0
    assert scope.source("qwen-1").api_key.reveal() == "sk-env-wins"
    assert scope.source("qwen-2").model == "qwen-turbo"
    assert scope.global_limits.rpm == 5
    assert scope.global_limits.max_concurrency == 16  # untouched file value stays


def test_flat_env_keys_beat_file_defaults_but_not_file_scope_tables(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
[defaults.retry]
max_attempts = 5
[defaults.breaker]
fail_threshold = 2
[scopes.LLM.breaker]
cooldown_s = 11
""",
    )
    env = {
        **source_env("LLM"),
        "LLM_MAX_RETRIES": "2",
        "LLM_CIRCUIT_BREAKER_THRESHOLD": "6",
        "LLM_CIRCUIT_BREAKER_COOLDOWN": "99",
    }
    scope = load_scope("LLM", env, pipeline_path=path)
    assert scope.retry.max_attempts == 2  # flat env > [defaults]
    assert scope.breaker.fail_threshold == 6  # flat env > [defaults]
    assert scope.breaker.cooldown_s == 11.0  # [scopes.LLM] > flat env


def test_env_keys_complete_a_source_described_in_the_file(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
[[scopes.LLM.sources]]
provider = "qwen"
base_url = "http://127.0.0.1:8400/v1"
""",
    )
    env = {"LLM__QWEN__1__MODEL": "qwen-plus", "LLM__QWEN__1__API_KEY": "sk-x"}
    source = load_scope("LLM", env, pipeline_path=path).source("qwen-1")
    assert (source.model, source.api_key.reveal()) == ("qwen-plus", "sk-x")
    # Without the env key the file's source misses its model: both spellings are named.
    with pytest.raises(ConfigError) as excinfo:
        load_scope("LLM", {}, pipeline_path=path)
    assert one_problem_with(
        problems_of(excinfo), f"{path}:[scopes.LLM.sources[0]].model", "required"
    )


def test_state_shorthand_and_specific_choices(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
[scopes.LLM]
state = "memory"
[scopes.LLM.cache]
backend = "none"
""",
        "state.toml",
    )
    env = {**source_env("LLM"), "REDIS_URL": "redis://127.0.0.1:6379/3"}
    scope = load_scope("LLM", env, pipeline_path=path)
    assert (scope.limiter.name, scope.breaker_backend.name, scope.cache.backend) == (
        "memory",
        "memory",
        "none",
    )
    # Env shorthand and env specific key: the specific one wins within the env layer.
    env.update(
        {
            "PGW_STATE_BACKEND": "redis",
            "PGW_LIMITER_BACKEND": "memory",
            "PGW_CACHE_NAMESPACE": "n",
            "PGW_CACHE_TTL_S": "60",
        }
    )
    scope = load_scope("LLM", env)
    assert (scope.limiter.name, scope.breaker_backend.name, scope.cache.backend) == (
        "memory",
        "redis",
        "redis",
    )


def test_pipeline_file_location(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path, "[scopes.LLM.retry]\nmax_attempts = 7\n")  # ./pgw.toml (cwd is tmp_path)
    other = write(tmp_path, "[scopes.LLM.retry]\nmax_attempts = 8\n", "other.toml")
    third = write(tmp_path, "[scopes.LLM.retry]\nmax_attempts = 9\n", "third.toml")
    env = source_env("LLM")
    assert load_scope("LLM", env).retry.max_attempts == 7
    assert load_scope("LLM", {**env, "PGW_CONFIG": str(other)}).retry.max_attempts == 8
    # An explicit pipeline_path (e.g. `pgw config check --file`) wins over PGW_CONFIG.
    scope = load_scope("LLM", {**env, "PGW_CONFIG": str(other)}, pipeline_path=third)
    assert scope.retry.max_attempts == 9
    with pytest.raises(ConfigError, match="PGW_CONFIG: file not found"):
        load_settings({**env, "PGW_CONFIG": str(tmp_path / "missing.toml")})
    with pytest.raises(ConfigError, match="pipeline_path: file not found"):
        load_settings(env, pipeline_path=tmp_path / "missing.toml")


@pytest.mark.parametrize(
    ("text", "key", "needle"),
    [
        (
            "[scopes.LLM.retry]\nmax_atempts = 3\n",
            "[scopes.LLM.retry].max_atempts",
            "allowed: base_delay_s, call_deadline_s, max_attempts, max_delay_s",
        ),
        (
            "[scopes.LLM]\nretries = 3\n",
            "[scopes.LLM].retries",
            "allowed: backpressure, batch_concurrency, batch_size",
        ),
        ("[defaults.cache]\nttl = 3\n", "[defaults.cache].ttl", "allowed: backend, namespace"),
        ("scope = 1\n", "scope", "allowed: defaults, ignore_keys, plugins, scopes"),
        (
            '[scopes.LLM.retry]\nmax_attempts = "three"\n',
            "[scopes.LLM.retry].max_attempts",
            "must be an integer, got 'three'",
        ),
        (
            '[scopes.LLM.backpressure]\nquota_full = "queue"\n',
            "[scopes.LLM.backpressure].quota_full",
            "'wait' or 'fail_fast', got 'queue'",
        ),
        ("[scopes.LLM.global]\nrpm = -1\n", "[scopes.LLM.global].rpm", "must be >= 0, got -1"),
        ("[scopes.LLM]\nretry = 3\n", "[scopes.LLM].retry", "must be a table"),
        ('[scopes.LLM]\nmiddleware = "retry"\n', "[scopes.LLM].middleware", "must be a list"),
        ("[scopes.LLM]\nsources = {}\n", "[scopes.LLM].sources", "array of tables"),
        (
            '[[scopes.LLM.sources]]\nprovider = "qwen"\nmodle = "x"\n',
            "[scopes.LLM.sources[0]].modle",
            "allowed: api_key, api_key_env, base_url",
        ),
        (
            '[[scopes.LLM.sources]]\nbase_url = "http://h/v1"\nmodel = "m"\n',
            "[scopes.LLM.sources[0]].provider",
            "required",
        ),
        (
            '[[scopes.LLM.sources]]\nprovider = "qw en"\n',
            "[scopes.LLM.sources[0]].provider",
            "letter or digit",
        ),
        (
            '[[scopes.LLM.sources]]\nprovider = "qwen"\nbase_url = "h"\nmodel = "m"\n'
            "timeout_s = 0\n",
            "[scopes.LLM.sources[0]].timeout_s",
            "must be > 0, got 0",
        ),
        ('[scopes."bad-name"]\n', "[scopes].bad-name", "scope name"),
        (
            '[defaults]\n[[defaults.sources]]\nprovider = "q"\n',
            "[defaults].sources",
            "sources belong to a scope",
        ),
    ],
)
def test_file_problems_name_table_and_key(tmp_path: Path, text: str, key: str, needle: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as excinfo:
        load_settings(source_env("LLM"), pipeline_path=path)
    assert one_problem_with(problems_of(excinfo), f"{path}:{key}", needle)


def test_invalid_toml_is_one_clear_problem(tmp_path: Path) -> None:
    path = write(tmp_path, "[scopes.LLM\nx = 1\n")
    with pytest.raises(ConfigError) as excinfo:
        load_settings({}, pipeline_path=path)
    assert problems_of(excinfo) == [problems_of(excinfo)[0]]
    assert problems_of(excinfo)[0].startswith(f"{path}: invalid TOML")


def test_api_key_env_indirection_problems(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
[[scopes.LLM.sources]]
provider = "qwen"
base_url = "http://127.0.0.1:8400/v1"
model = "m"
api_key_env = "MISSING_KEY_VAR"

[[scopes.LLM.sources]]
provider = "qwen"
base_url = "http://127.0.0.1:8400/v1"
model = "m"
api_key = "sk-inline-secret"
api_key_env = "OTHER"
""",
    )
    with pytest.raises(ConfigError) as excinfo:
        load_settings({"OTHER": "sk-other-secret"}, pipeline_path=path)
    problems = problems_of(excinfo)
    assert one_problem_with(
        problems, f"{path}:[scopes.LLM.sources[0]].api_key_env", "env key MISSING_KEY_VAR"
    )
    assert one_problem_with(problems, "[scopes.LLM.sources[1]].api_key", "set only one of")
    assert not any("sk-inline-secret" in p or "sk-other-secret" in p for p in problems)


def test_duplicate_and_conflicting_sources(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
[[scopes.LLM.sources]]
provider = "qwen"
name = "main"
base_url = "http://127.0.0.1:8400/v1"
model = "m"

[[scopes.LLM.sources]]
provider = "openai"
name = "main"
base_url = "http://127.0.0.1:8400/v1"
model = "m"

[[scopes.LLM.sources]]
provider = "deepseek"
name = "qwen-1"
base_url = "http://127.0.0.1:8400/v1"
model = "m"
""",
    )
    with pytest.raises(ConfigError) as excinfo:
        load_settings(source_env("LLM"), pipeline_path=path)
    problems = problems_of(excinfo)
    assert one_problem_with(problems, "[scopes.LLM.sources[1]].name", "'main' is already used")
    assert one_problem_with(problems, "LLM__QWEN__1__*", "provider 'deepseek'")


def test_file_scope_names_are_case_insensitive(tmp_path: Path) -> None:
    path = write(tmp_path, "[scopes.llm.retry]\nmax_attempts = 2\n")
    assert load_scope("LLM", source_env("LLM"), pipeline_path=path).retry.max_attempts == 2
    path = write(tmp_path, "[scopes.llm]\n[scopes.LLM]\n", "dup.toml")
    with pytest.raises(ConfigError, match="same scope as"):
        load_settings({}, pipeline_path=path)


def test_middleware_options_for_a_layer_not_in_the_list(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
[scopes.LLM]
middleware = ["retry"]
[scopes.LLM.middleware_options.cache]
size = 1
""",
    )
    with pytest.raises(ConfigError) as excinfo:
        load_settings(source_env("LLM"), pipeline_path=path)
    assert one_problem_with(
        problems_of(excinfo), "[scopes.LLM.middleware_options.cache]", "not in the middleware list"
    )
