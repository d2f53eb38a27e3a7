"""Scopes of other call kinds (``CallKind``): where their sources' transports are looked up,
their defaults, and transport options written as source fields."""

from __future__ import annotations

from typing import Any

import pytest
from polygateway.config import CHAT_CALLS, CallKind, load_scope, load_settings
from polygateway.errors import ConfigError
from polygateway.hookspecs import hookimpl
from polygateway.plugins import Registry, load_registry
from polygateway.ports import Register
from polygateway.settings import SourceConfig

OCR_LIKE = CallKind(
    transport_kind="ocr_transport",
    default_transport="scanner",
    default_model="scan-model",
    source_options={"MODE": "mode", "DPI": "dpi"},
    provider_profiles=False,
)


class _Scanner:
    """A plugin registering an OCR transport ``scanner`` (never built here)."""

    @staticmethod
    @hookimpl
    def pgw_register_ocr_transports(register: Register) -> None:
        def scanner(source: SourceConfig) -> Any:  # pragma: no cover - only named
            raise AssertionError("not built by the loader")

        register("scanner", scanner)


def registry() -> Registry:
    return load_registry(autoload=False, extra_plugins=[("scanner", _Scanner)])


def test_a_call_kind_defaults_transport_and_model_and_reads_its_options() -> None:
    env = {
        "SCAN__PAPER__1__BASE_URL": "http://127.0.0.1:9/",
        "SCAN__PAPER__1__MODE": "split",
        "SCAN__PAPER__1__DPI": "300",
        "SCAN__PAPER__1__TIMEOUT_S": "90",
    }
    scope = load_scope("SCAN", env, registry=registry(), call_kind=OCR_LIKE)
    [source] = scope.sources
    assert (source.transport, source.model, source.provider) == ("scanner", "scan-model", "paper")
    assert dict(source.options) == {"mode": "split", "dpi": "300"}
    assert source.timeout_s == 90.0
    # The same keys in a chat scope: MODEL required, MODE unknown, no "scanner" transport.
    with pytest.raises(ConfigError) as caught:
        load_scope("SCAN", env, registry=registry())
    problems = "\n".join(caught.value.problems)
    assert "SCAN__PAPER__1__MODE: unknown source field MODE" in problems
    assert "SCAN__PAPER__1__MODEL: required (source paper-1)" in problems


def test_each_scope_is_checked_against_its_own_call_kind() -> None:
    env = {
        "LLM__OPENAI__1__BASE_URL": "http://127.0.0.1:9/",
        "LLM__OPENAI__1__MODEL": "m",
        "SCAN__PAPER__1__BASE_URL": "http://127.0.0.1:9/",
    }
    settings = load_settings(env, registry=registry(), call_kinds={"scan": OCR_LIKE})
    assert settings.scope("SCAN").sources[0].transport == "scanner"
    assert settings.scope("LLM").sources[0].transport == "openai-compat"
    chat_named = {**env, "SCAN__PAPER__1__TRANSPORT": "openai-compat"}
    with pytest.raises(ConfigError) as caught:
        load_settings(chat_named, registry=registry(), call_kinds={"SCAN": OCR_LIKE})
    assert caught.value.problems == (
        "SCAN__PAPER__1__TRANSPORT: ocr_transport 'openai-compat' is not registered; "
        "registered ocr_transport names: scanner",
    )
    assert CHAT_CALLS.transport_kind == "transport"


NO_PROBE = CallKind(
    transport_kind="ocr_transport",
    default_transport="scanner",
    default_model="scan-model",
    provider_profiles=False,
    no_health_probe="every scan runs the model",
)


def test_the_health_probe_of_a_call_kind_without_one_is_refused_naming_the_key() -> None:
    env = {"SCAN__PAPER__1__BASE_URL": "http://127.0.0.1:9/"}
    scope = load_scope("SCAN", env, registry=registry(), call_kind=NO_PROBE)
    assert scope.breaker.health_probe is False  # unset, or off: fine
    off = {**env, "SCAN__BREAKER__HEALTH_PROBE": "false"}
    assert (
        load_scope("SCAN", off, registry=registry(), call_kind=NO_PROBE).breaker.health_probe
        is False
    )
    with pytest.raises(ConfigError) as caught:
        load_scope(
            "SCAN", {**env, "SCAN__BREAKER__HEALTH_PROBE": "true"}, registry=registry(),
            call_kind=NO_PROBE,
        )  # fmt: skip
    [problem] = caught.value.problems
    assert problem.startswith("SCAN__BREAKER__HEALTH_PROBE: scope SCAN has no background health")
    assert "every scan runs the model" in problem
    # A chat scope has its probe: the same key is fine there.
    chat = {
        "SCAN__OPENAI__1__BASE_URL": "http://127.0.0.1:9/v1",
        "SCAN__OPENAI__1__MODEL": "m",
        "SCAN__BREAKER__HEALTH_PROBE": "true",
    }
    assert load_scope("SCAN", chat, registry=registry()).breaker.health_probe is True


def test_a_governed_client_given_no_probe_refuses_the_setting() -> None:
    """Settings built by hand skip the loader: ``GovernedParts`` refuses the probe it would
    otherwise ignore, before building anything."""
    import dataclasses

    from polygateway.governed import GovernedParts

    env = {"SCAN__PAPER__1__BASE_URL": "http://127.0.0.1:9/"}
    scope = load_scope("SCAN", env, registry=registry(), call_kind=NO_PROBE)
    probing = dataclasses.replace(
        scope, breaker=dataclasses.replace(scope.breaker, health_probe=True)
    )
    for kind, why in ((NO_PROBE, "every scan runs the model"), (CHAT_CALLS, "no cheap request")):
        with pytest.raises(ConfigError, match="SCAN__BREAKER__HEALTH_PROBE") as caught:
            GovernedParts(probing, call_kind=kind, registry=registry())
        assert why in str(caught.value)
