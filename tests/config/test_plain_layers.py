"""The plain reading of a layer (``layer_values.read_plain``) against its definition, the
pydantic model: same fields in the same order, and wherever the plain reading accepts a layer
(the example configuration files, the env examples, generated layers) it gives exactly what
the model gives, with no problem; a layer it does not accept goes to the model."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from polygateway.config import env as envkeys
from polygateway.config import layer_models, layer_values
from polygateway.config import pipeline as pipefile
from polygateway.config.layer_values import SCOPE_COMMON, SOURCE, SPECS, LayerSpec, read_plain

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_TOML = ROOT / "pgw.example.toml"
EXAMPLE_ENV = ROOT / ".env.example"


def _by_model(raw: dict[str, Any], spec: LayerSpec) -> tuple[dict[str, Any], list[str]]:
    model = getattr(layer_models, spec.model)
    return layer_models.validate_layer_with_model(raw, model, lambda loc: str(loc))


def _agrees(raw: dict[str, Any], spec: LayerSpec) -> bool:
    """Whether the plain reading accepted ``raw``; fails the test if it disagrees."""
    plain = read_plain(raw, spec)
    if plain is None:
        return False
    data, problems = _by_model(raw, spec)
    assert problems == []
    assert list(plain.items()) == list(data.items())  # values and their order
    assert [type(v) for v in plain.values()] == [type(v) for v in data.values()]
    return True


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.model)
def test_the_same_fields_in_the_same_order(spec: LayerSpec) -> None:
    model = getattr(layer_models, spec.model)
    assert [name for name, _ in spec.fields] == [
        info.alias or name for name, info in model.model_fields.items()
    ]


def _file_layers(path: Path) -> list[tuple[dict[str, Any], LayerSpec]]:
    pipeline, problems = pipefile.read(path)
    assert problems == [] and pipeline is not None
    layers: list[tuple[dict[str, Any], LayerSpec]] = []
    if pipeline.defaults is not None:
        layers.append((pipeline.defaults, SCOPE_COMMON))
    for scope in pipeline.scopes.values():
        layers.append((scope.settings, SCOPE_COMMON))
        layers.extend((entry, SOURCE) for entry in scope.sources if entry is not None)
    return layers


def _env_layers(values: dict[str, str]) -> list[tuple[dict[str, Any], LayerSpec]]:
    config = envkeys.parse_env(values)
    layers: list[tuple[dict[str, Any], LayerSpec]] = [(config.flat, SCOPE_COMMON)]
    for scope in config.scopes.values():
        layers.append((scope.settings, SCOPE_COMMON))
        layers.extend((source.values, SOURCE) for source in scope.ordered_sources())
    return layers


def test_every_layer_of_the_example_files_reads_plainly_and_agrees() -> None:
    layers = _file_layers(EXAMPLE_TOML)
    layers += _env_layers(envkeys.read_env({}, dotenv_path=EXAMPLE_ENV))
    layers += _env_layers(
        {
            "LLM__OPENAI__1__BASE_URL": "http://127.0.0.1:9/v1",
            "LLM__OPENAI__1__API_KEY": "sk-bench",
            "LLM__OPENAI__1__MODEL": "bench-model",
            "LLM__OPENAI__1__TIMEOUT_S": "2.5s",
            "LLM__RETRY__MAX_ATTEMPTS": "3",
            "LLM_TIMEOUT": "30",
            "PGW_CACHE_BACKEND": "none",
        }
    )
    assert len(layers) > 5
    assert all(_agrees(raw, spec) for raw, spec in layers)


def test_a_bad_value_goes_to_the_model() -> None:
    for raw in (
        {"timeout_s": "soon"},
        {"max_concurrency": "-1"},
        {"base_url": "ftp://x"},
        {"model": "  "},
        {"temperature": "0.5"},  # a string: the model's float parsing decides
        {"unknown": 1},
    ):
        assert read_plain(raw, SOURCE) is None


# Values of every shape the layers see: env strings, TOML scalars, lists and tables, and the
# edges of each range.
_SCALARS = st.one_of(
    st.sampled_from(
        [
            "",
            " ",
            "0",
            "1",
            "-1",
            "2",
            "2.5",
            " 3 ",
            "1e3",
            "500ms",
            "2s",
            "1m",
            "1h",
            "inf",
            "nan",
            "true",
            "False",
            "yes",
            "off",
            "retry",
            "salvage",
            "wait",
            "fail_fast",
            "full",
            "digest",
            "none",
            "aiohttp",
            "httpx2",
            "qwen",
            "Qwen-1",
            "-x",
            "a b",
            "http://127.0.0.1:9/v1",
            " https://h/ ",
            "http://",
            "ftp://h",
            "http://[::1",
            "2147483647",
            "2147483648",
            "31622400",
            "31622401",
            "memory",
            "sqlite",
        ]
    ),
    st.integers(-3, 3),
    st.sampled_from([2**31 - 1, 2**31, 31622400, 31622401, 10**20]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
)
_VALUES = st.one_of(
    _SCALARS,
    st.lists(_SCALARS, max_size=3),
    st.dictionaries(st.sampled_from(["a", " b", "url", "1"]), _SCALARS, max_size=2),
)


def _layers(spec: LayerSpec, depth: int = 0) -> st.SearchStrategy[dict[str, Any]]:
    names = [name for name, _ in spec.fields]
    value = _VALUES
    if spec is SCOPE_COMMON and depth == 0:
        nested = {s.model: s for s in SPECS}
        tables = {
            "retry": nested["RetryLayer"],
            "breaker": nested["BreakerLayer"],
            "backpressure": nested["BackpressureLayer"],
            "global": nested["GlobalLayer"],
            "limiter": nested["LimiterLayer"],
            "cache": nested["CacheLayer"],
            "telemetry": nested["TelemetryLayer"],
            "structured": nested["StructuredLayer"],
            "source_defaults": nested["SourceDefaultsLayer"],
        }
        return st.fixed_dictionaries(
            {},
            optional={
                name: (_layers(tables[name], 1) if name in tables else value) for name in names
            },
        )
    return st.fixed_dictionaries({}, optional={name: value for name in names})


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.model)
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_generated_layers_agree_wherever_read_plainly(spec: LayerSpec, data: Any) -> None:
    raw = data.draw(_layers(spec))
    _agrees(raw, spec)


def test_plain_values_of_every_reader_are_accepted() -> None:
    # Not vacuous: each reader accepts the values a configuration usually writes.
    samples: dict[Any, Any] = {
        layer_values.POSITIVE_DURATION: "2.5s",
        layer_values.NON_NEGATIVE_DURATION: "0",
        layer_values.POSITIVE_INT: "3",
        layer_values.NON_NEGATIVE_INT: 0,
    }
    for read, value in samples.items():
        assert not math.isnan(read(value))


def test_loading_the_default_configuration_builds_no_layer_model() -> None:
    code = (
        "import sys\n"
        "from polygateway.config import load_scope\n"
        "load_scope('LLM', {'LLM__OPENAI__1__BASE_URL': 'http://127.0.0.1:9/v1',"
        " 'LLM__OPENAI__1__MODEL': 'm'})\n"
        "print('polygateway.config.layer_models' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
