"""A list of telemetry backends (a fan-out): env comma lists, pipeline-file lists, options per
sink, and the problems of a bad list."""

from __future__ import annotations

from pathlib import Path

import pytest
from config_testlib import (
    FakeRegistry,
    one_problem_with,
    postgres_like_registry,
    problems_of,
    source_env,
)
from polygateway.config import load_settings
from polygateway.config.describe import describe_scope
from polygateway.errors import ConfigError

SECRET = "pw-never-shown"


def test_one_backend_is_unchanged() -> None:
    scope = load_settings(source_env("LLM")).scopes["LLM"]
    assert (scope.telemetry.backend, scope.telemetry.backends) == ("sqlite", ("sqlite",))
    off = load_settings({**source_env("LLM"), "PGW_TELEMETRY_BACKEND": "none"}).scopes["LLM"]
    assert (off.telemetry.backend, off.telemetry.backends) == ("none", ())


def test_a_comma_list_in_the_env_picks_every_backend_with_its_own_options() -> None:
    registry = postgres_like_registry()
    dsn = f"postgresql://pgw:{SECRET}@127.0.0.1:5432/polygateway"
    env = {
        **source_env("LLM"),
        "PGW_TELEMETRY_BACKEND": " sqlite , postgres ",
        "PGW_TELEMETRY_PG_DSN": dsn,
    }
    scope = load_settings(env, registry=registry).scopes["LLM"]
    assert scope.telemetry.backends == ("sqlite", "postgres")
    assert scope.telemetry.backend == "sqlite,postgres"
    options = scope.telemetry.options
    assert set(options) == {"sqlite", "postgres"}
    assert options["postgres"].dsn.reveal() == dsn
    described = describe_scope(scope)
    assert described["effective"]["telemetry_sinks"] == ["sqlite", "postgres"]
    assert SECRET not in str(described)
    # A required option of one sink names the key that would set it and the list naming it.
    with pytest.raises(ConfigError) as excinfo:
        load_settings({**env, "PGW_TELEMETRY_PG_DSN": ""}, registry=registry)
    one_problem_with(problems_of(excinfo), "PGW_TELEMETRY_PG_DSN", "'postgres'")


def test_a_list_in_the_pipeline_file_with_options_per_sink(tmp_path: Path) -> None:
    pipeline = tmp_path / "pgw.toml"
    pipeline.write_text(
        "[scopes.LLM.telemetry]\n"
        'backend = ["sqlite", "postgres"]\n'
        "[scopes.LLM.telemetry.options.postgres]\n"
        f'dsn = "postgresql://pgw:{SECRET}@127.0.0.1/db"\n'
    )
    scope = load_settings(
        source_env("LLM"), pipeline_path=pipeline, registry=postgres_like_registry()
    ).scopes["LLM"]
    assert scope.telemetry.backends == ("sqlite", "postgres")
    assert scope.telemetry.options["postgres"].dsn.reveal().endswith("@127.0.0.1/db")


@pytest.mark.parametrize(
    ("value", "needle"),
    [("sqlite,sqlite", "more than once"), ("sqlite,none", "switches telemetry off")],
)
def test_a_bad_list_is_one_problem_naming_the_key(value: str, needle: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_settings({**source_env("LLM"), "PGW_TELEMETRY_BACKEND": value})
    one_problem_with(problems_of(excinfo), "PGW_TELEMETRY_BACKEND", needle)


def test_an_unknown_sink_in_a_list_is_named() -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_settings(
            {**source_env("LLM"), "PGW_TELEMETRY_BACKEND": "sqlite,nosuch"},
            registry=FakeRegistry(),
        )
    one_problem_with(problems_of(excinfo), "'nosuch' is not registered", "sqlite")
