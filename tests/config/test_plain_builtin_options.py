"""The plain values of the core's memory cache and sqlite recorder options
(``builtin_values``) against their definition, the pydantic models (``builtin_options``): same
fields, order and defaults; wherever the plain reader accepts options (the example
configuration, generated values) it gives what the model gives, and whatever the model
refuses the plain reader leaves to it. A default load imports no options model."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from polygateway import builtin_values
from polygateway.builtin_options import MemoryCacheOptions, SQLiteTelemetryOptions
from polygateway.config import load_scope
from polygateway.errors import ConfigError
from polygateway.plugins import load_registry
from pydantic import BaseModel, ValidationError

ROOT = Path(__file__).resolve().parents[2]
PAIRS: list[tuple[type[BaseModel], type[Any], Callable[[Mapping[str, Any]], Any]]] = [
    (MemoryCacheOptions, builtin_values.MemoryCacheValues, builtin_values.read_memory_cache),
    (
        SQLiteTelemetryOptions,
        builtin_values.SQLiteTelemetryValues,
        builtin_values.read_sqlite_telemetry,
    ),
]
IDS = [model.__name__ for model, _, _ in PAIRS]


def _agrees(model: type[BaseModel], read: Callable[[Mapping[str, Any]], Any], raw: Any) -> bool:
    """Whether the plain reader accepted ``raw``; fails the test if it disagrees."""
    plain = read(raw)
    try:
        expected = model.model_validate(raw).model_dump()
    except ValidationError:
        assert plain is None
        return False
    if plain is None:
        return False
    assert dataclasses.asdict(plain) == expected
    assert [type(v) for v in dataclasses.asdict(plain).values()] == [
        type(v) for v in expected.values()
    ]
    return True


@pytest.mark.parametrize(("model", "values", "read"), PAIRS, ids=IDS)
def test_the_same_fields_order_and_defaults(
    model: type[BaseModel], values: type[Any], read: Callable[[Mapping[str, Any]], Any]
) -> None:
    assert list(dataclasses.asdict(values()).items()) == list(model().model_dump().items())
    assert dataclasses.asdict(read({})) == model().model_dump()


def _options_tables(node: Any, kind: str) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == kind and isinstance(value, dict) and isinstance(value.get("options"), dict):
                yield value["options"]
            yield from _options_tables(value, kind)


def test_the_example_configuration_reads_plainly_and_agrees() -> None:
    document = tomllib.loads((ROOT / "pgw.example.toml").read_text())
    found = 0
    for (model, _, read), kind in zip(PAIRS, ("cache", "telemetry"), strict=True):
        for table in _options_tables(document, kind):
            assert _agrees(model, read, table)
            found += 1
    assert found >= 1


_VALUES = st.one_of(
    st.integers(min_value=-3, max_value=2**60),
    st.integers(min_value=1, max_value=10**6).map(str),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["250ms", "2s", "1m", "0", "-1", " 7 ", "1e3", "yes", "", "inf", "nan", "8.0"]),
    st.booleans(),
    st.none(),
    st.lists(st.integers(), max_size=2),
)


@pytest.mark.parametrize(("model", "values", "read"), PAIRS, ids=IDS)
@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_generated_options_agree_wherever_read_plainly(
    model: type[BaseModel],
    values: type[Any],
    read: Callable[[Mapping[str, Any]], Any],
    data: Any,
) -> None:
    names = [field.name for field in dataclasses.fields(values)]
    keys = st.sampled_from([*names, "unknown", f"{names[0]}_env"])
    raw = data.draw(st.dictionaries(keys, _VALUES, max_size=4))
    _agrees(model, read, raw)


def test_a_configured_scope_gets_the_plain_values_the_model_would_give() -> None:
    env = {
        "LLM__OPENAI__1__BASE_URL": "http://127.0.0.1:9/v1",
        "LLM__OPENAI__1__MODEL": "m",
        "LLM__CACHE__MAX_ENTRIES": "12",
        "LLM__TELEMETRY__FLUSH_INTERVAL_S": "250ms",
    }
    scope = load_scope("LLM", env, registry=load_registry(autoload=False))
    assert isinstance(scope.cache.options, builtin_values.MemoryCacheValues)
    assert dataclasses.asdict(scope.cache.options) == {"max_entries": 12}
    assert dataclasses.asdict(scope.telemetry.options) == (
        SQLiteTelemetryOptions(flush_interval_s=0.25).model_dump()
    )


def test_a_bad_value_is_the_models_problem() -> None:
    env = {
        "LLM__OPENAI__1__BASE_URL": "http://127.0.0.1:9/v1",
        "LLM__OPENAI__1__MODEL": "m",
        "LLM__CACHE__MAX_ENTRIES": "0",
    }
    with pytest.raises(ConfigError) as caught:
        load_scope("LLM", env, registry=load_registry(autoload=False))
    assert str(caught.value) == "LLM__CACHE__MAX_ENTRIES: must be >= 1, got '0'"


def test_loading_the_default_configuration_imports_no_options_model() -> None:
    code = (
        "import sys\n"
        "from polygateway.config import load_scope\n"
        "from polygateway.plugins import load_registry\n"
        "load_scope('LLM', {'LLM__OPENAI__1__BASE_URL': 'http://127.0.0.1:9/v1',"
        " 'LLM__OPENAI__1__MODEL': 'm'}, registry=load_registry())\n"
        "print(sorted(m for m in sys.modules if m == 'pydantic' or m.endswith('.options')"
        " and m != 'polygateway.options' or m.endswith(('builtin_options', 'option_types'))))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_a_ready_client_of_the_default_configuration_imports_no_pydantic_nor_json_repair(
    tmp_path: Path,
) -> None:
    # json_repair is imported by the first repair of a structured answer; tomllib by the first
    # pipeline file read (the working directory has none); argparse by the CLI; difflib by a
    # misspelt hook's suggestion; aiohttp (two SSL contexts from the CA store at import) by a
    # source on the aiohttp engine. Each is start-up time a ready client does not need.
    code = (
        "import sys\n"
        "from polygateway import GatewayClient\n"
        "GatewayClient.from_env(env={'LLM__OPENAI__1__BASE_URL': 'http://127.0.0.1:9/v1',"
        " 'LLM__OPENAI__1__API_KEY': 'sk-test', 'LLM__OPENAI__1__MODEL': 'm'})\n"
        "print([m for m in ('pydantic', 'json_repair', 'tomllib', 'argparse', 'difflib', 'aiohttp')"
        " if m in sys.modules])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path
    )
    assert done.stdout.strip() == "[]"
