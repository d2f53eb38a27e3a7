"""A plugin registers its options model by reference (``OptionsRef``): registration and the
unknown-key check read the declared flat keys without importing the model; it is imported when
the component's options are used, and must declare the flat keys its reference does.
Registering the model class directly (``test_plugin_options.py``) still works alongside."""

from __future__ import annotations

import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest
from polygateway import hookimpl
from polygateway.builtin_options import MemoryCacheOptions
from polygateway.builtin_values import MemoryCacheValues
from polygateway.config import load_scope
from polygateway.errors import ConfigError, PluginError
from polygateway.options import OptionsRef
from polygateway.plugins import Registry, load_registry
from polygateway.ports import Register

OPTIONS_SOURCE = """
from typing import Annotated

from polygateway.options import ComponentOptions, EnvKey, PositiveInt


class GateOptions(ComponentOptions):
    url: Annotated[str, EnvKey("GATE_URL")] = "gate://default"
    size: PositiveInt = 4
"""

SOURCE = {"LLM__QWEN__1__BASE_URL": "http://127.0.0.1:9/v1", "LLM__QWEN__1__MODEL": "m"}
GATE = {
    **SOURCE,
    "PGW_CACHE_BACKEND": "gate",
    "PGW_CACHE_NAMESPACE": "n",
    "PGW_CACHE_TTL_S": "60",
}


class GatePlugin:
    """A cache plugin whose options model lives in ``module``, named by reference."""

    def __init__(self, options: OptionsRef) -> None:
        self.options = options

    @hookimpl
    def pgw_register_caches(self, register: Register) -> None:
        def gate(ctx: Any) -> Any:
            from polygateway.backends.memory.cache import MemoryCache

            return MemoryCache(clock=ctx.clock, max_entries=ctx.options.size)

        register("gate", gate, options=self.options)


@pytest.fixture
def options_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    module = f"gate_options_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(OPTIONS_SOURCE), encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    return module


def _registry(options: OptionsRef) -> Registry:
    return load_registry(autoload=False, extra_plugins=[("pgw-gate", GatePlugin(options))])


def test_the_model_is_imported_only_when_its_options_are_used(options_module: str) -> None:
    registry = _registry(OptionsRef(f"{options_module}:GateOptions", env_keys={"url": "GATE_URL"}))
    assert ("cache", "gate", {"url": "GATE_URL"}) in registry.flat_env_keys()
    load_scope("LLM", SOURCE, registry=registry)  # the scope picks the memory cache
    assert options_module not in sys.modules

    env = {**GATE, "LLM__CACHE__SIZE": "9"}
    scope = load_scope("LLM", env, registry=registry)
    assert options_module in sys.modules
    assert type(scope.cache.options).__name__ == "GateOptions"
    assert scope.cache.options.size == 9
    model = registry.options_of("cache", "gate")
    assert model is not None and isinstance(scope.cache.options, model)


def test_a_problem_names_the_key_as_for_a_model_class(options_module: str) -> None:
    registry = _registry(OptionsRef(f"{options_module}:GateOptions", env_keys={"url": "GATE_URL"}))
    env = {**GATE, "LLM__CACHE__SIZE": "0"}
    with pytest.raises(ConfigError) as caught:
        load_scope("LLM", env, registry=registry)
    assert "LLM__CACHE__SIZE" in str(caught.value)


def test_flat_keys_that_differ_from_the_model_are_refused(options_module: str) -> None:
    registry = _registry(OptionsRef(f"{options_module}:GateOptions", env_keys={"url": "GATE"}))
    with pytest.raises(PluginError, match="flat keys"):
        registry.options_of("cache", "gate")


def test_a_reference_to_nothing_is_the_plugins_problem(options_module: str) -> None:
    registry = _registry(OptionsRef(f"{options_module}:Missing"))
    with pytest.raises(PluginError, match="pgw-gate"):
        registry.options_of("cache", "gate")


@pytest.mark.parametrize(
    "options",
    [
        OptionsRef("no_colon"),
        OptionsRef("module:"),
        OptionsRef("module:Model", plain=MemoryCacheValues),
    ],
)
def test_a_malformed_reference_fails_the_plugin(options: OptionsRef) -> None:
    registry = _registry(options)
    [info] = [info for info in registry.plugins if info.name == "pgw-gate"]
    assert info.status == "failed" and "OptionsRef" in (info.error or "")


def test_resolve_options_accepts_a_mapping_the_model_and_the_plain_values() -> None:
    registry = load_registry(autoload=False)
    assert registry.resolve_options("cache", "memory", {"max_entries": "5"}) == (
        MemoryCacheValues(max_entries=5)
    )
    plain = MemoryCacheValues(max_entries=3)
    assert registry.resolve_options("cache", "memory", plain) is plain
    model = MemoryCacheOptions(max_entries=3)
    assert registry.resolve_options("cache", "memory", model) is model
    with pytest.raises(ConfigError, match="max_entries"):
        registry.resolve_options("cache", "memory", {"max_entries": 0})
