"""Plugin discovery and the registry: builtin, duplicates, failures, PGW_PLUGINS, lookups."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
import warnings
from pathlib import Path
from typing import Any

import polygateway
import pytest
from plugin_dists import BROKEN_PLUGIN_SOURCE, GOOD_PLUGIN_SOURCE, install_fake_plugin
from polygateway import PluginError, hookimpl
from polygateway.hookspecs import HOOK_KINDS
from polygateway.plugins import PluginInfo, Registry, load_registry, parse_plugin_filter


class TransportPlugin:
    """Registers one transport (a plain object stands in for the factory)."""

    def __init__(self, *names: str) -> None:
        self.names = names
        self.factory = object()

    @hookimpl
    def pgw_register_transports(self, register: Any) -> None:
        for name in self.names:
            register(name, self.factory)


class LimiterPlugin:
    @hookimpl
    def pgw_register_limiters(self, register: Any) -> None:
        register("memory", object())


class HalfBrokenPlugin:
    """One hook works, one raises after registering something."""

    @hookimpl
    def pgw_register_caches(self, register: Any) -> None:
        register("half-cache", object())

    @hookimpl
    def pgw_register_selectors(self, register: Any) -> None:
        register("half-selector", object())
        raise RuntimeError("selector backend misconfigured")


class MisspelledHookPlugin:
    @hookimpl
    def pgw_register_transport(self, register: Any) -> None:
        register("never", object())


class WrongArgumentPlugin:
    @hookimpl
    def pgw_register_transports(self, reg: Any) -> None:
        reg("never", object())


class AsyncHookPlugin:
    @hookimpl
    async def pgw_register_transports(self, register: Any) -> None:
        register("never", object())


class NoArgumentPlugin:
    """pluggy lets an implementation take fewer arguments than its spec."""

    called = False

    @hookimpl
    def pgw_register_pricing(self) -> None:
        NoArgumentPlugin.called = True


def info(registry: Registry, name: str) -> PluginInfo:
    matches = [p for p in registry.plugins if p.name == name]
    assert len(matches) == 1, [p.name for p in registry.plugins]
    return matches[0]


# --------------------------------------------------------------------------- builtin


def test_builtin_is_a_plugin_like_any_other() -> None:
    registry = load_registry(autoload=False)
    core = registry.plugins[0]
    assert core.name == "polygateway-core"
    assert core.version == importlib.metadata.version("polygateway-core")
    assert core.entry_point == ""
    # Every hook but those of the call kinds whose transports only plugins ship.
    call_kind_hooks = {"pgw_register_embedding_transports", "pgw_register_ocr_transports"}
    assert set(core.hooks) == set(HOOK_KINDS) - call_kind_hooks
    assert "openai-compat" in core.provides["transport"]
    assert {"round_robin", "least_inflight"} <= set(core.provides["selector"])
    assert {"plugins", "config"} <= set(core.provides["command"])
    assert registry.provider_of("transport", "openai-compat") == "polygateway-core"
    assert registry.names("limiter") == ["memory"]
    assert callable(registry.get("limiter", "memory"))


def test_builtin_plugin_loads_cleanly() -> None:
    core = load_registry(autoload=False).plugins[0]
    assert (core.status, core.error) == ("loaded", None)


def test_each_call_builds_a_fresh_registry() -> None:
    with_plugin = load_registry(autoload=False, extra_plugins=[("pgw-one", TransportPlugin("x"))])
    without = load_registry(autoload=False)
    assert "x" in with_plugin.names("transport")
    assert "x" not in without.names("transport")
    assert [p.name for p in without.plugins] == ["polygateway-core"]


# --------------------------------------------------------------------------- extra plugins


def test_extra_plugin_registers_through_the_same_hooks() -> None:
    plugin = TransportPlugin("alpha", "beta")
    registry = load_registry(autoload=False, extra_plugins=[("pgw-alpha", plugin)])
    assert registry.get("transport", "alpha") is plugin.factory
    assert registry.provider_of("transport", "beta") == "pgw-alpha"
    assert registry.names("transport") == sorted(["alpha", "beta", "openai-compat"])
    alpha = info(registry, "pgw-alpha")
    assert alpha.status == "loaded"
    assert alpha.error is None
    assert alpha.hooks == ("pgw_register_transports",)
    assert dict(alpha.provides) == {"transport": ("alpha", "beta")}


def test_plugin_info_is_frozen() -> None:
    alpha = info(
        load_registry(autoload=False, extra_plugins=[("pgw-a", TransportPlugin("a"))]), "pgw-a"
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        alpha.status = "failed"  # type: ignore[misc]
    with pytest.raises(TypeError):
        alpha.provides["transport"] = ()  # type: ignore[index]


def test_implementation_may_take_fewer_arguments_than_the_spec() -> None:
    NoArgumentPlugin.called = False
    registry = load_registry(autoload=False, extra_plugins=[("pgw-noarg", NoArgumentPlugin())])
    assert NoArgumentPlugin.called
    assert info(registry, "pgw-noarg").status == "loaded"


# --------------------------------------------------------------------------- duplicates


def test_two_plugins_with_the_same_name_is_an_error_naming_both() -> None:
    with pytest.raises(PluginError) as caught:
        load_registry(
            autoload=False,
            extra_plugins=[
                ("pgw-first", TransportPlugin("dup")),
                ("pgw-second", TransportPlugin("dup")),
            ],
        )
    message = str(caught.value)
    assert "transport 'dup'" in message
    assert "pgw-first" in message
    assert "pgw-second" in message


def test_clash_with_a_builtin_name_names_the_core_too() -> None:
    with pytest.raises(PluginError) as caught:
        load_registry(autoload=False, extra_plugins=[("pgw-limits", LimiterPlugin())])
    assert "limiter 'memory'" in str(caught.value)
    assert "polygateway-core" in str(caught.value)
    assert "pgw-limits" in str(caught.value)


def test_same_name_for_different_kinds_is_fine() -> None:
    class Both:
        @hookimpl
        def pgw_register_caches(self, register: Any) -> None:
            register("shared-name", "cache")

        @hookimpl
        def pgw_register_telemetry(self, register: Any) -> None:
            register("shared-name", "telemetry")

    registry = load_registry(autoload=False, extra_plugins=[("pgw-both", Both())])
    assert registry.get("cache", "shared-name") == "cache"
    assert registry.get("telemetry", "shared-name") == "telemetry"


def test_plugin_registering_one_name_twice_fails_alone() -> None:
    registry = load_registry(
        autoload=False,
        extra_plugins=[("pgw-twice", TransportPlugin("t", "t")), ("pgw-ok", TransportPlugin("ok"))],
    )
    twice = info(registry, "pgw-twice")
    assert twice.status == "failed"
    assert "registered twice" in (twice.error or "")
    assert "t" not in registry.names("transport")
    assert registry.provider_of("transport", "ok") == "pgw-ok"


# --------------------------------------------------------------------------- failing plugins


def test_hook_that_raises_marks_its_plugin_failed_and_keeps_the_others() -> None:
    registry = load_registry(
        autoload=False,
        extra_plugins=[("pgw-half", HalfBrokenPlugin()), ("pgw-fine", TransportPlugin("fine"))],
    )
    half = info(registry, "pgw-half")
    assert half.status == "failed"
    assert "pgw_register_selectors raised RuntimeError: selector backend misconfigured" in (
        half.error or ""
    )
    # What the raising hook registered before raising is withdrawn; the other hook counts.
    assert "half-selector" not in registry.names("selector")
    assert registry.provider_of("cache", "half-cache") == "pgw-half"
    assert info(registry, "pgw-fine").status == "loaded"


def test_misspelled_hook_fails_that_plugin_with_a_suggestion() -> None:
    registry = load_registry(
        autoload=False,
        extra_plugins=[("pgw-typo", MisspelledHookPlugin()), ("pgw-fine", TransportPlugin("f"))],
    )
    typo = info(registry, "pgw-typo")
    assert typo.status == "failed"
    assert "unknown hook 'pgw_register_transport'" in (typo.error or "")
    assert "did you mean 'pgw_register_transports'" in (typo.error or "")
    assert typo.provides == {}
    assert "never" not in registry.names("transport")
    assert info(registry, "pgw-fine").status == "loaded"


def test_hook_with_wrong_argument_name_fails_that_plugin() -> None:
    registry = load_registry(autoload=False, extra_plugins=[("pgw-args", WrongArgumentPlugin())])
    args = info(registry, "pgw-args")
    assert args.status == "failed"
    assert "reg" in (args.error or "")
    assert "never" not in registry.names("transport")


def test_async_hook_fails_that_plugin_without_a_never_awaited_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        registry = load_registry(autoload=False, extra_plugins=[("pgw-async", AsyncHookPlugin())])
    failed = info(registry, "pgw-async")
    assert failed.status == "failed"
    assert "plain functions" in (failed.error or "")


def test_register_refuses_a_non_string_name() -> None:
    class BadName:
        @hookimpl
        def pgw_register_caches(self, register: Any) -> None:
            register(42, object())

    bad = info(load_registry(autoload=False, extra_plugins=[("pgw-bad", BadName())]), "pgw-bad")
    assert bad.status == "failed"
    assert "non-empty string name, got 42" in (bad.error or "")


# --------------------------------------------------------------------------- lookups


def test_get_unknown_name_lists_the_registered_names() -> None:
    registry = load_registry(autoload=False, extra_plugins=[("pgw-t", TransportPlugin("zeta"))])
    with pytest.raises(PluginError) as caught:
        registry.get("transport", "nope")
    first = caught.value.problems[0]
    assert "unknown transport 'nope'" in first
    assert "openai-compat" in first
    assert "zeta" in first
    with pytest.raises(PluginError, match="unknown transport 'nope'"):
        registry.provider_of("transport", "nope")


def test_get_unknown_kind_lists_the_kinds() -> None:
    registry = load_registry(autoload=False)
    with pytest.raises(PluginError, match=r"unknown plugin kind 'transports'.*transport"):
        registry.get("transports", "openai-compat")
    with pytest.raises(PluginError):
        registry.names("nope")


def test_get_unknown_name_mentions_every_failed_plugin_with_install_hint() -> None:
    registry = load_registry(autoload=False, extra_plugins=[("pgw-half", HalfBrokenPlugin())])
    with pytest.raises(PluginError) as caught:
        registry.get("limiter", "redis")
    problems = caught.value.problems
    assert len(problems) == 2
    assert "plugin pgw-half failed to load" in problems[1]
    assert "selector backend misconfigured" in problems[1]
    assert "pip install --force-reinstall pgw-half" in problems[1]


def test_require_plugin_that_is_not_installed() -> None:
    registry = load_registry(autoload=False)
    with pytest.raises(
        PluginError, match=r"pgw-nothing is not installed .*install the distribution that provides"
    ):
        registry.require_plugin("pgw-nothing")
    registry.require_plugin("polygateway-core")


# --------------------------------------------------------------------------- entry points


@pytest.fixture
def fake_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


ONLY_FAKES = ["pgw-good-example", "pgw-broken-example"]


@pytest.fixture
def good_and_broken(fake_site: Path) -> Path:
    install_fake_plugin(
        fake_site,
        "pgw-good-example",
        "good",
        GOOD_PLUGIN_SOURCE.format(transport="good-transport", command="hello-good"),
    )
    install_fake_plugin(fake_site, "pgw-broken-example", "broken", BROKEN_PLUGIN_SOURCE)
    return fake_site


def test_failing_import_is_recorded_and_never_breaks_the_others(
    good_and_broken: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="polygateway.plugins"):
        registry = load_registry(allowed=ONLY_FAKES)
    assert [p.name for p in registry.plugins] == ["polygateway-core", *sorted(ONLY_FAKES)]
    good = info(registry, "pgw-good-example")
    assert (good.status, good.version, good.entry_point) == ("loaded", "1.2.3", "good")
    assert dict(good.provides) == {"transport": ("good-transport",), "command": ("hello-good",)}
    assert good.hooks == ("pgw_register_commands", "pgw_register_transports")
    assert registry.provider_of("transport", "good-transport") == "pgw-good-example"

    broken = info(registry, "pgw-broken-example")
    assert (broken.status, broken.entry_point, broken.hooks) == ("failed", "broken", ())
    assert broken.error == (
        "ModuleNotFoundError: No module named 'pgw_test_dependency_that_is_not_installed'"
    )
    assert broken.provides == {}
    assert "pgw-broken-example" in caplog.text


def test_require_plugin_that_failed_gives_import_error_and_pip_hint(good_and_broken: Path) -> None:
    registry = load_registry(allowed=ONLY_FAKES)
    registry.require_plugin("pgw-good-example")
    registry.require_plugin("good")  # the entry-point name works too
    for name in ("pgw-broken-example", "broken", "PGW_Broken_Example"):
        with pytest.raises(PluginError) as caught:
            registry.require_plugin(name)
        message = str(caught.value)
        assert "No module named 'pgw_test_dependency_that_is_not_installed'" in message
        assert "pip install pgw_test_dependency_that_is_not_installed" in message


def test_unknown_name_while_a_plugin_failed_points_at_it(good_and_broken: Path) -> None:
    registry = load_registry(allowed=ONLY_FAKES)
    with pytest.raises(PluginError) as caught:
        registry.get("limiter", "redis")
    message = str(caught.value)
    assert "unknown limiter 'redis'" in message
    assert "pgw-broken-example (entry point 'broken') failed to load" in message
    assert "pgw_test_dependency_that_is_not_installed" in message
    assert "pip install pgw_test_dependency_that_is_not_installed" in message


def test_empty_filter_loads_the_builtin_only(good_and_broken: Path) -> None:
    registry = load_registry(allowed=parse_plugin_filter(""))
    assert [p.name for p in registry.plugins] == ["polygateway-core"]
    assert "good-transport" not in registry.names("transport")
    with pytest.raises(PluginError, match="PGW_PLUGINS does not include it"):
        registry.require_plugin("pgw-good-example")
    with pytest.raises(PluginError, match=r"not in PGW_PLUGINS.*pgw-broken-example"):
        registry.get("transport", "good-transport")


@pytest.mark.parametrize("selector", ["good", "pgw-good-example", "PGW_GOOD_EXAMPLE"])
def test_filter_matches_entry_point_or_distribution_name(
    good_and_broken: Path, selector: str
) -> None:
    registry = load_registry(allowed=[selector])
    assert [p.name for p in registry.plugins] == ["polygateway-core", "pgw-good-example"]
    assert registry.provider_of("transport", "good-transport") == "pgw-good-example"


def test_no_filter_loads_every_installed_plugin(good_and_broken: Path) -> None:
    names = [p.name for p in load_registry(allowed=None).plugins]
    assert set(ONLY_FAKES) <= set(names)


def test_filter_name_matching_nothing_is_warned_about(
    good_and_broken: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="polygateway.plugins"):
        load_registry(allowed=["good", "goood"])
    assert "PGW_PLUGINS names goood but no installed plugin matches" in caplog.text


def test_autoload_off_ignores_entry_points(good_and_broken: Path) -> None:
    assert [p.name for p in load_registry(autoload=False).plugins] == ["polygateway-core"]


def test_duplicate_between_installed_distributions_names_both(fake_site: Path) -> None:
    for dist in ("pgw-dup-one", "pgw-dup-two"):
        install_fake_plugin(
            fake_site, dist, dist, GOOD_PLUGIN_SOURCE.format(transport="same", command=dist)
        )
    with pytest.raises(PluginError) as caught:
        load_registry(allowed=["pgw-dup-one", "pgw-dup-two"])
    assert caught.value.problems == (
        "transport 'same' is registered by both pgw-dup-one and pgw-dup-two; uninstall one "
        "or leave one out of PGW_PLUGINS",
    )


# --------------------------------------------------------------------------- PGW_PLUGINS parsing


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("", []),
        ("  ", []),
        ("redis", ["redis"]),
        (" redis , pgw-postgres ,", ["redis", "pgw-postgres"]),
    ],
)
def test_parse_plugin_filter(value: str | None, expected: list[str] | None) -> None:
    assert parse_plugin_filter(value) == expected


def test_core_version_matches_package() -> None:
    assert load_registry(autoload=False).plugins[0].version == polygateway.__version__
