"""Assembly guards (ARCHITECTURE §7.3/§7.6, M2 §1/§3), middleware order, registry names."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from config_testlib import FakeRegistry, one_problem_with, problems_of, source_env
from polygateway import hookimpl
from polygateway.config import (
    check_guards,
    load_scope,
    load_settings,
    validate_against_registry,
)
from polygateway.errors import ConfigError, PluginError
from polygateway.plugins import Registry, load_registry
from polygateway.settings import (
    BackpressureSettings,
    BreakerSettings,
    GatewaySettings,
    ScopeSettings,
    SourceConfig,
)


def guard_problems(env: dict[str, str]) -> list[str]:
    with pytest.raises(ConfigError) as excinfo:
        load_settings(env)
    return problems_of(excinfo)


def test_valid_timeouts_pass() -> None:
    env = source_env("LLM", TIMEOUT_S="60", TTFT_TIMEOUT_S="20", INTER_TOKEN_TIMEOUT_S="5")
    assert check_guards(load_scope("LLM", env)) == []


def test_inter_token_must_be_below_ttft() -> None:
    env = source_env("LLM", TIMEOUT_S="60", TTFT_TIMEOUT_S="20", INTER_TOKEN_TIMEOUT_S="20")
    line = one_problem_with(guard_problems(env), "LLM__QWEN__1__INTER_TOKEN_TIMEOUT_S:")
    assert "20 must be < TTFT_TIMEOUT_S 20" in line


def test_ttft_must_be_below_timeout() -> None:
    env = source_env("LLM", TIMEOUT_S="30", TTFT_TIMEOUT_S="45")
    line = one_problem_with(guard_problems(env), "LLM__QWEN__1__TTFT_TIMEOUT_S:")
    assert "45 must be < TIMEOUT_S 30" in line


def test_inter_token_must_be_below_timeout_without_ttft() -> None:
    env = source_env("LLM", TIMEOUT_S="30", INTER_TOKEN_TIMEOUT_S="31")
    assert one_problem_with(
        guard_problems(env), "LLM__QWEN__1__INTER_TOKEN_TIMEOUT_S:", "< TIMEOUT_S"
    )


def test_flat_ttft_above_the_default_timeout_is_refused() -> None:
    env = {**source_env("LLM"), "LLM_TTFT_TIMEOUT": "200"}  # default timeout_s is 120
    # Named by the key the user set, not by the per-source spelling it stands for.
    line = one_problem_with(guard_problems(env), "LLM_TTFT_TIMEOUT:", "200 must be <")
    assert "TIMEOUT_S 120 (the default; set LLM__QWEN__1__TIMEOUT_S to change it" in line


def test_timeout_must_fit_in_the_lease_ttl() -> None:
    env = {**source_env("LLM", TIMEOUT_S="120"), "LLM__BACKPRESSURE__LEASE_TTL_S": "60"}
    line = one_problem_with(guard_problems(env), "LLM__BACKPRESSURE__LEASE_TTL_S")
    assert "lease TTL 60 must be >= the longest source timeout 120 (qwen-1)" in line
    assert line.startswith("LLM__BACKPRESSURE__LEASE_TTL_S: ")  # the key the user set


def test_probe_ttl_must_outlive_the_longest_timeout() -> None:
    env = {
        **source_env("LLM", TIMEOUT_S="120"),
        **source_env("LLM", "DEEPSEEK", 1, TIMEOUT_S="30"),
        "LLM__BREAKER__PROBE_TTL_S": "124",
    }
    line = one_problem_with(guard_problems(env), "LLM__BREAKER__PROBE_TTL_S")
    assert "124 must be >= the longest source timeout + 5 = 125 (qwen-1)" in line
    env["LLM__BREAKER__PROBE_TTL_S"] = "125"
    assert load_scope("LLM", env).probe_ttl_s == 125.0


def test_stall_window_must_cover_the_slowest_first_token() -> None:
    env = {
        **source_env("LLM", TIMEOUT_S="120", TTFT_TIMEOUT_S="40"),
        "LLM__BACKPRESSURE__STALL_WINDOW_S": "30",
    }
    line = one_problem_with(guard_problems(env), "LLM__BACKPRESSURE__STALL_WINDOW_S")
    assert "30 must be >= the longest TTFT timeout 40 (qwen-1)" in line


def test_derived_defaults_satisfy_the_guards_even_for_short_timeouts() -> None:
    # probe TTL default = max(2 x 2, cooldown 1, 2 + 5) = 7 >= 2 + 5.
    env = {**source_env("LLM", TIMEOUT_S="2"), "LLM__BREAKER__COOLDOWN_S": "1"}
    scope = load_scope("LLM", env)
    assert scope.probe_ttl_s == 7.0
    assert scope.lease_ttl_s == 32.0


def test_check_guards_on_hand_built_settings() -> None:
    source = SourceConfig(
        name="a", provider="generic", base_url="http://h/v1", model="m", timeout_s=10.0
    )
    good = ScopeSettings(scope="X", sources=(source,))
    assert check_guards(good) == []
    bad = ScopeSettings(
        scope="X",
        sources=(
            dataclasses.replace(source, ttft_timeout_s=0.0),
            dataclasses.replace(source, timeout_s=100.0),
        ),
        breaker=BreakerSettings(probe_ttl_s=50.0),
        backpressure=BackpressureSettings(lease_ttl_s=90.0),
    )
    problems = check_guards(bad)
    assert one_problem_with(problems, "name='a'", "source names must be unique")
    assert one_problem_with(problems, "ttft_timeout_s: must be > 0")
    assert one_problem_with(problems, "X__BACKPRESSURE__LEASE_TTL_S", "lease TTL 90")
    assert one_problem_with(problems, "X__BREAKER__PROBE_TTL_S", "50 must be >= ")


@pytest.mark.parametrize(
    ("layers", "needle"),
    [
        ('["cache", "cache", "retry"]', "repeated: cache"),
        ('["telemetry", "telemetry"]', "repeated: telemetry"),
    ],
)
def test_middleware_order(tmp_path: Path, layers: str, needle: str) -> None:
    path = tmp_path / "mw.toml"
    path.write_text(f"[scopes.LLM]\nmiddleware = {layers}\n", encoding="utf-8")
    with pytest.raises(ConfigError) as excinfo:
        load_settings(source_env("LLM"), pipeline_path=path)
    assert one_problem_with(problems_of(excinfo), "[scopes.LLM].middleware", needle)


@pytest.mark.parametrize(
    ("layers", "expected"),
    [
        # Refused while the retry layer had to be present and last; the dispatcher is now
        # pinned innermost, so any order of the wrapping layers is valid.
        ('["telemetry", "cache"]', ("telemetry", "cache")),
        ('["retry", "cache"]', ("retry", "cache")),
        ("[]", ()),
    ],
)
def test_any_middleware_order_is_valid(
    tmp_path: Path, layers: str, expected: tuple[str, ...]
) -> None:
    path = tmp_path / "mw.toml"
    path.write_text(f"[scopes.LLM]\nmiddleware = {layers}\n", encoding="utf-8")
    scope = load_settings(source_env("LLM"), pipeline_path=path).scope("LLM")
    assert scope.middleware == expected
    assert check_guards(scope) == []


def test_guards_do_not_fire_on_values_replacing_rejected_ones() -> None:
    # A rejected TIMEOUT_S must not also produce "ttft must be < timeout (default 120)".
    problems = guard_problems(source_env("LLM", TIMEOUT_S="soon", TTFT_TIMEOUT_S="150"))
    assert problems == [one_problem_with(problems, "LLM__QWEN__1__TIMEOUT_S", "must be a number")]


def test_guards_still_run_when_an_unrelated_value_is_rejected() -> None:
    problems = guard_problems(source_env("LLM", RPM="lots", TIMEOUT_S="30", TTFT_TIMEOUT_S="40"))
    assert one_problem_with(problems, "LLM__QWEN__1__RPM", "must be an integer")
    assert one_problem_with(problems, "LLM__QWEN__1__TTFT_TIMEOUT_S", "40 must be < TIMEOUT_S 30")


# --------------------------------------------------------------------------- registry


def test_registry_accepts_the_builtin_choices() -> None:
    settings = load_settings(source_env("LLM"), registry=FakeRegistry())
    assert validate_against_registry(settings, FakeRegistry()) == []


@pytest.mark.parametrize(
    ("extra_env", "key", "registered"),
    [
        (
            {"PGW_LIMITER_BACKEND": "leaky"},
            "PGW_LIMITER_BACKEND",
            "registered limiter names: memory",
        ),
        ({"PGW_BREAKER_BACKEND": "zk"}, "PGW_BREAKER_BACKEND", "registered breaker names: memory"),
        (
            {"PGW_CACHE_BACKEND": "disk", "PGW_CACHE_NAMESPACE": "n", "PGW_CACHE_TTL_S": "5"},
            "PGW_CACHE_BACKEND",
            "registered cache names: memory",
        ),
        ({"PGW_TELEMETRY_BACKEND": "kafka"}, "PGW_TELEMETRY_BACKEND", "names: sqlite"),
        (
            {"LLM__SELECTOR": "random"},
            "LLM__SELECTOR",
            "registered selector names: least_inflight, round_robin",
        ),
        ({"LLM__STRUCTURED__STRATEGY": "regex"}, "LLM__STRUCTURED__STRATEGY", "json-repair"),
        ({"LLM__QWEN__1__TRANSPORT": "grpc"}, "LLM__QWEN__1__TRANSPORT", "names: openai-compat"),
        (
            source_env("LLM", "ACME", 1),
            "LLM__ACME__1__*",
            "provider profile 'acme' is not registered; registered provider names: "
            "deepseek, generic, openai, qwen",
        ),
    ],
)
def test_unknown_implementation_names_the_key_and_registered_names(
    extra_env: dict[str, str], key: str, registered: str
) -> None:
    env = {**source_env("LLM"), **extra_env}
    with pytest.raises(ConfigError) as excinfo:
        load_settings(env, registry=FakeRegistry())
    assert one_problem_with(problems_of(excinfo), key, registered)
    # The same problem without the loader, from resolved settings.
    settings = load_settings(env)
    assert one_problem_with(validate_against_registry(settings, FakeRegistry()), key, registered)


def test_unknown_middleware_names_the_registered_layers(tmp_path: Path) -> None:
    path = tmp_path / "mw.toml"
    path.write_text('[scopes.LLM]\nmiddleware = ["audit", "retry"]\n', encoding="utf-8")
    with pytest.raises(ConfigError) as excinfo:
        load_settings(source_env("LLM"), pipeline_path=path, registry=FakeRegistry())
    line = one_problem_with(problems_of(excinfo), "[scopes.LLM].middleware", "'audit'")
    assert "registered middleware names: cache, retry, structured, telemetry" in line
    registry = FakeRegistry({"middleware": ["audit"]})
    assert load_scope(
        "LLM", source_env("LLM"), pipeline_path=path, registry=registry
    ).middleware == (
        "audit",
        "retry",
    )


def test_disabled_backends_are_not_looked_up() -> None:
    env = {**source_env("LLM"), "PGW_CACHE_BACKEND": "none", "PGW_TELEMETRY_BACKEND": "none"}
    registry = FakeRegistry()
    registry._names["cache"] = []
    registry._names["telemetry"] = []
    assert load_scope("LLM", env, registry=registry).cache.backend == "none"


class _MissingDependency:
    """A plugin whose import of its client library fails (as ``pip install`` would fix)."""

    def __init__(self, module: str) -> None:
        self.module = module

    @hookimpl
    def pgw_register_limiters(self, register: Any) -> None:
        raise ModuleNotFoundError(f"No module named {self.module!r}")


def _registry_with_failed(dist: str, module: str) -> Registry:
    return load_registry(autoload=False, extra_plugins=[(dist, _MissingDependency(module))])


def test_plugin_backend_without_the_plugin_gets_an_install_hint() -> None:
    env = {
        **source_env("LLM"),
        "PGW_STATE_BACKEND": "redis",
        "REDIS_URL": "redis://127.0.0.1:6379/3",
        "PGW_CACHE_NAMESPACE": "n",
        "PGW_CACHE_TTL_S": "60",
    }
    with pytest.raises(ConfigError) as excinfo:
        load_settings(env, registry=_registry_with_failed("pgw-redis", "redis"))
    # The loader names the key that made the choice: here the shorthand. The hint comes from
    # the registry's record of the plugin that failed, not from a table of plugin names.
    line = one_problem_with(problems_of(excinfo), "PGW_STATE_BACKEND", "limiter 'redis'")
    assert "pip install redis" in line  # the missing module, not the plugin (installed)
    assert "No module named 'redis'" in line
    assert excinfo.type is PluginError  # what from_env raises too
    assert one_problem_with(problems_of(excinfo), "PGW_STATE_BACKEND", "cache 'redis'")
    with_redis = FakeRegistry({"limiter": ["redis"], "breaker": ["redis"], "cache": ["redis"]})
    assert load_scope("LLM", env, registry=with_redis).limiter.name == "redis"


def test_validate_against_registry_covers_every_scope() -> None:
    env = {**source_env("LLM"), **source_env("OCR", "MONKEY", 1, TRANSPORT="monkeyocr")}
    settings = load_settings(env)
    problems = validate_against_registry(settings, FakeRegistry())
    assert one_problem_with(problems, "OCR__MONKEY__1__TRANSPORT", "transport 'monkeyocr'")
    failed = _registry_with_failed("pgw-monkeyocr", "monkeyocr_sdk")
    problems_with_hint = validate_against_registry(settings, failed)
    assert one_problem_with(
        problems_with_hint, "OCR__MONKEY__1__TRANSPORT", "pip install monkeyocr_sdk"
    )
    assert one_problem_with(problems, "OCR__MONKEY__1__*", "'monkey'")
    assert not any("LLM" in p for p in problems)
    assert validate_against_registry(GatewaySettings(scopes={}), FakeRegistry()) == []


def test_the_real_plugin_registry() -> None:
    from polygateway.plugins import load_registry

    registry = load_registry(allowed=[])
    assert load_scope("LLM", source_env("LLM"), registry=registry).sources[0].provider == "qwen"
    with pytest.raises(ConfigError, match="PGW_LIMITER_BACKEND"):
        load_settings({**source_env("LLM"), "PGW_LIMITER_BACKEND": "nope"}, registry=registry)
