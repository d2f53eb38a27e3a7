"""Backend choices (cache, telemetry, pricing), a plugin's options (a Postgres-like telemetry
declaring its DSN) and secrets never shown. The Redis choices are pgw-redis's tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from config_testlib import one_problem_with, postgres_like_registry, problems_of, source_env
from polygateway.config import describe_settings, load_scope, load_settings
from polygateway.errors import ConfigError

SECRET = "s3cr3t-SENTINEL-9f2c"


def test_cache_defaults_and_explicit_choices() -> None:
    scope = load_scope("LLM", source_env("LLM"))
    assert (scope.cache.backend, scope.cache.namespace, scope.cache.ttl_s) == (
        "memory",
        "default",
        3600.0,
    )
    env = {**source_env("LLM"), "PGW_CACHE_BACKEND": "memory"}
    with pytest.raises(ConfigError) as excinfo:
        load_settings(env)
    problems = problems_of(excinfo)
    assert one_problem_with(problems, "PGW_CACHE_NAMESPACE", "PGW_CACHE_BACKEND=memory")
    assert one_problem_with(problems, "PGW_CACHE_TTL_S", "must be > 0")
    env.update({"LLM__CACHE__NAMESPACE": "tenant-a", "PGW_CACHE_TTL_S": "120"})
    scope = load_scope("LLM", env)
    assert (scope.cache.namespace, scope.cache.ttl_s) == ("tenant-a", 120.0)
    off = load_scope("LLM", {**source_env("LLM"), "PGW_CACHE_BACKEND": "none"})
    assert off.cache.backend == "none"


def test_telemetry_backends() -> None:
    scope = load_scope("LLM", source_env("LLM"))
    assert (scope.telemetry.backend, scope.telemetry.sqlite_path) == ("sqlite", "pgw_telemetry.db")
    assert not hasattr(scope.telemetry, "pg_dsn")  # a plugin's option, not a core field
    registry = postgres_like_registry()
    env = {**source_env("LLM"), "PGW_TELEMETRY_BACKEND": "postgres"}
    with pytest.raises(ConfigError) as excinfo:
        load_settings(env, registry=registry)
    assert one_problem_with(
        problems_of(excinfo), "PGW_TELEMETRY_PG_DSN", "PGW_TELEMETRY_BACKEND=postgres"
    )
    dsn = f"postgresql://pgw:{SECRET}@127.0.0.1:5432/polygateway"
    scope = load_scope("LLM", {**env, "PGW_TELEMETRY_PG_DSN": dsn}, registry=registry)
    assert scope.telemetry.options.dsn.reveal() == dsn
    with pytest.raises(ConfigError) as excinfo:
        load_settings(
            {**env, "PGW_TELEMETRY_PG_DSN": f"mysql://u:{SECRET}@h/db"}, registry=registry
        )
    assert one_problem_with(problems_of(excinfo), "PGW_TELEMETRY_PG_DSN", "postgresql://")
    assert SECRET not in str(excinfo.value)
    custom = load_scope(
        "LLM",
        {
            **source_env("LLM"),
            "PGW_TELEMETRY_SQLITE_PATH": "x.db",
            "LLM__TELEMETRY__BACKEND": "none",
        },
    )
    assert (custom.telemetry.backend, custom.telemetry.sqlite_path) == ("none", "x.db")


def test_pg_dsn_from_the_file_through_an_env_indirection(tmp_path: Path) -> None:
    path = tmp_path / "tel.toml"
    path.write_text(
        '[defaults.telemetry]\nbackend = "postgres"\n'
        '[defaults.telemetry.options]\ndsn_env = "MY_DSN"\n',
        encoding="utf-8",
    )
    registry = postgres_like_registry()
    dsn = f"postgres://u:{SECRET}@h/db"
    scope = load_scope(
        "LLM", {**source_env("LLM"), "MY_DSN": dsn}, pipeline_path=path, registry=registry
    )
    assert scope.telemetry.options.dsn.reveal() == dsn
    with pytest.raises(ConfigError) as excinfo:
        load_settings(source_env("LLM"), pipeline_path=path, registry=registry)
    assert one_problem_with(
        problems_of(excinfo), f"{path}:[defaults.telemetry.options].dsn_env", "env key MY_DSN"
    )


def test_pricing_path_must_exist(tmp_path: Path) -> None:
    env = {**source_env("LLM"), "PGW_PRICING_PATH": str(tmp_path / "missing.json")}
    with pytest.raises(ConfigError) as excinfo:
        load_settings(env)
    assert one_problem_with(problems_of(excinfo), "PGW_PRICING_PATH", "not found or not readable")
    table = tmp_path / "pricing.json"
    table.write_text("{}", encoding="utf-8")
    assert load_scope("LLM", {**env, "PGW_PRICING_PATH": str(table)}).pricing_path == str(table)


# --------------------------------------------------------------------------- secrets


def secret_env() -> dict[str, str]:
    return {
        **source_env("LLM", API_KEY=SECRET),
        "PGW_CACHE_NAMESPACE": "n",
        "PGW_CACHE_TTL_S": "60",
        "PGW_TELEMETRY_BACKEND": "postgres",
        "PGW_TELEMETRY_PG_DSN": f"postgresql://pgw:{SECRET}@127.0.0.1:5432/db",
    }


def test_secrets_never_appear_in_describe_or_reprs(tmp_path: Path) -> None:
    path = tmp_path / "opts.toml"
    path.write_text(
        f'[scopes.LLM.limiter.options]\npassword = "{SECRET}"\npool = 4\n'
        f'[scopes.LLM.middleware_options.telemetry]\napi_token = "{SECRET}"\n',
        encoding="utf-8",
    )
    settings = load_settings(secret_env(), pipeline_path=path, registry=postgres_like_registry())
    described = describe_settings(settings)
    text = json.dumps(described)  # JSON-able
    assert SECRET not in text
    scope = described["scopes"]["LLM"]
    assert scope["sources"][0]["api_key"] == "***"
    # A plugin's secret option: masked, the host still visible (the Redis URL: pgw-redis tests).
    assert scope["telemetry"]["options"] == {
        "dsn": "postgresql://pgw:***@127.0.0.1:5432/db",
        "batch_size": 100,
    }
    assert scope["limiter"]["options"] == {"password": "***", "pool": 4}
    assert scope["effective"]["probe_ttl_s"] == settings.scope("LLM").probe_ttl_s
    for shown in (repr(settings), str(settings), repr(settings.scope("LLM").sources[0])):
        assert SECRET not in shown


@pytest.mark.parametrize(
    "bad",
    [
        {"LLM__QWEN__1__TIMEOUT_S": "x"},
        {"LLM__QWEN__1__BASE_URL": f"ftp://u:{SECRET}@h/v1"},
        {"LLM__BREAKER__PROBE_TTL_S": "1"},
        {"PGW_TELEMETRY_PG_DSN": f"{SECRET}"},
        {"LLM__TELEMETRY__DSN": f"{SECRET}"},
        {"LLM__TELEMETRY__BATCH_SIZE": "0", "LLM__TELEMETRY__PASSWORD": f"{SECRET}"},
    ],
)
def test_secrets_never_appear_in_problems(bad: dict[str, str]) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_settings({**secret_env(), **bad}, registry=postgres_like_registry())
    assert SECRET not in str(excinfo.value)
    # Pydantic's error (which carries inputs) is not chained into the traceback.
    assert excinfo.value.__cause__ is None and excinfo.value.__context__ is None


def test_secrets_in_the_file_never_appear_in_problems(tmp_path: Path) -> None:
    path = tmp_path / "s.toml"
    path.write_text(
        f"""
[[scopes.LLM.sources]]
provider = "qwen"
base_url = "http://127.0.0.1:8400/v1"
model = "m"
apikey = "{SECRET}"

[[scopes.LLM.sources]]
provider = "qwen"
base_url = "http://127.0.0.1:8400/v1"
model = "m"
api_key = ["{SECRET}"]

[scopes.LLM.telemetry]
backend = "postgres"

[scopes.LLM.telemetry.options]
dsn = 12
""",
        encoding="utf-8",
    )
    with pytest.raises(ConfigError) as excinfo:
        load_settings({}, pipeline_path=path, registry=postgres_like_registry())
    problems = problems_of(excinfo)
    assert one_problem_with(problems, "[scopes.LLM.sources[0]].apikey", "unknown key")
    assert one_problem_with(problems, "[scopes.LLM.sources[1]].api_key", "must be a string")
    assert one_problem_with(problems, "[scopes.LLM.telemetry.options].dsn", "must be a string")
    assert SECRET not in str(excinfo.value)
    assert not any(", got 12" in p for p in problems)


def test_describe_warns_about_scopes_without_sources() -> None:
    settings = load_settings({**source_env("LLM"), "LMM__RETRY__MAX_ATTEMPTS": "2"})
    described = describe_settings(settings)
    assert described["scopes"]["LMM"]["sources"] == []
    assert described["warnings"] == [one_problem_with(described["warnings"], "LMM", "no sources")]


def test_describe_masks_url_queries_and_every_header_value() -> None:
    import dataclasses

    env = source_env("LLM", BASE_URL=f"https://gw.example/v1?api_key={SECRET}")
    settings = load_settings(env)
    source = settings.scopes["LLM"].sources[0]

    with_headers = dataclasses.replace(
        source, options={"headers": {"Cookie": f"session={SECRET}"}, "engine": "aiohttp"}
    )
    scope = dataclasses.replace(settings.scopes["LLM"], sources=(with_headers,))
    described = describe_settings(dataclasses.replace(settings, scopes={"LLM": scope}))
    text = repr(described)
    assert SECRET not in text
    assert SECRET not in repr(scope)  # options are kept out of the settings repr
    options = described["scopes"]["LLM"]["sources"][0]["options"]
    assert options["headers"] == {"Cookie": "***"}
    assert options["engine"] == "aiohttp"
    assert "gw.example" in described["scopes"]["LLM"]["sources"][0]["base_url"]
