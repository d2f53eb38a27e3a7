"""The shipped ``pgw.example.toml`` and ``.env.example`` load cleanly, alone and together."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from polygateway.config import describe_settings, load_scope, load_settings

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_TOML = ROOT / "pgw.example.toml"
EXAMPLE_ENV = ROOT / ".env.example"


@pytest.fixture(scope="module")
def registry() -> object:
    from polygateway.plugins import load_registry

    return load_registry(allowed=[])


@pytest.mark.parametrize(
    "files",
    [
        {"pipeline_path": EXAMPLE_TOML},
        {"dotenv_path": EXAMPLE_ENV},
        {"pipeline_path": EXAMPLE_TOML, "dotenv_path": EXAMPLE_ENV},
    ],
    ids=["toml", "env", "both"],
)
def test_examples_load_cleanly(files: dict[str, Path], registry: object) -> None:
    settings = load_settings({}, registry=registry, **files)  # type: ignore[arg-type]
    assert list(settings.scopes) == ["LLM"]
    scope = settings.scope("LLM")
    assert sorted(s.name for s in scope.sources) == ["deepseek-1", "qwen-1"]
    for source in scope.sources:
        assert source.base_url.startswith("http://127.0.0.1:8400/")
    assert scope.middleware == ("telemetry", "cache", "structured")
    assert (scope.cache.backend, scope.cache.namespace) == ("memory", "example")
    assert scope.telemetry.backend == "sqlite"
    assert scope.source("deepseek-1").ttft_timeout_s == 60.0
    assert describe_settings(settings)["warnings"] == []
    json.dumps(describe_settings(settings))


def test_the_env_example_supplies_the_keys_of_the_file_sources() -> None:
    scope = load_scope("LLM", {}, pipeline_path=EXAMPLE_TOML, dotenv_path=EXAMPLE_ENV)
    assert scope.source("qwen-1").api_key.reveal() == "sk-example-qwen"
    assert scope.source("qwen-1").options["engine"] == "httptools"
