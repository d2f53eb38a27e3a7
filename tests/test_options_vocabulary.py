"""One vocabulary for option values (``polygateway.options``): the parsers, and the proof that
core keys (scope keys, flat env keys, file values) and plugin options read values the same way;
and the typed registry surface (one ``get``/``build`` overload per kind)."""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import pytest
from polygateway.config import load_scope
from polygateway.errors import ConfigError
from polygateway.options import parse_bool, parse_duration, parse_int, parse_number
from polygateway.plugins import KINDS, Registry


@pytest.fixture(autouse=True)
def _empty_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (True, True), (False, False), (1, True), (0, False), ("true", True), ("FALSE", False),
        (" yes ", True), ("No", False), ("on", True), ("OFF", False), ("1", True), ("0", False),
    ],
)  # fmt: skip
def test_booleans_by_meaning(value: object, expected: bool) -> None:
    assert parse_bool(value) is expected


@pytest.mark.parametrize("value", ["maybe", "", "t", "y", 2, -1, None, 1.0, [True]])
def test_anything_else_is_not_a_boolean(value: object) -> None:
    with pytest.raises(ValueError, match="must be true or false"):
        parse_bool(value)


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (30, 30.0), (2.5, 2.5), ("2.5", 2.5), (" 7 ", 7.0), ("500ms", 0.5), ("2s", 2.0),
        ("1.5m", 90.0), ("1h", 3600.0), ("2 s", 2.0), ("1e3ms", 1.0), ("-1", -1.0),
    ],
)  # fmt: skip
def test_durations_in_seconds_with_or_without_a_unit(value: object, seconds: float) -> None:
    assert parse_duration(value) == seconds


@pytest.mark.parametrize(
    ("value", "message"),
    [("soon", "number of seconds"), ("2d", "number of seconds"), (True, "number of seconds"),
     ("inf", "finite"), (float("nan"), "finite"), ("nan", "finite")],
)  # fmt: skip
def test_bad_durations(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_duration(value)


def test_integers_and_numbers() -> None:
    assert (parse_int(3), parse_int(" 12 ")) == (3, 12)
    for bad in (8.0, "8.5", True, "x", None):
        with pytest.raises(ValueError, match="must be an integer"):
            parse_int(bad)
    assert (parse_number(2), parse_number("2.5"), parse_number(0.25)) == (2.0, 2.5, 0.25)
    for bad in (True, "x", [1]):
        with pytest.raises(ValueError, match="must be a number"):
            parse_number(bad)
    with pytest.raises(ValueError, match="finite"):
        parse_number("inf")


SOURCE = {"LLM__QWEN__1__BASE_URL": "http://127.0.0.1:9/v1", "LLM__QWEN__1__MODEL": "m"}


def test_core_keys_speak_the_same_vocabulary(tmp_path: Path) -> None:
    env = {
        **SOURCE,
        "LLM__QWEN__1__ENABLE_THINKING": "on",  # scope (source) key
        "LLM__QWEN__1__TIMEOUT_S": "2m",
        "LLM_TTFT_TIMEOUT": "30s",  # flat key
        "LLM__BREAKER__COOLDOWN_S": "1500ms",
        "LLM__CACHE__MAX_ENTRIES": "12",  # a builtin component's option
    }
    scope = load_scope("LLM", env)
    source = scope.sources[0]
    assert (source.enable_thinking, source.timeout_s, source.ttft_timeout_s) == (True, 120, 30)
    assert scope.breaker.cooldown_s == 1.5
    assert scope.cache.options.max_entries == 12
    path = tmp_path / "pgw.toml"
    path.write_text(
        "[scopes.LLM.source_defaults]\ntrust_env = 'off'\ninter_token_timeout_s = '5s'\n"
        "[scopes.LLM.telemetry.options]\nflush_interval_s = '250ms'\n",
        encoding="utf-8",
    )
    scope = load_scope("LLM", SOURCE, pipeline_path=path)
    assert scope.sources[0].options["trust_env"] is False
    assert scope.sources[0].inter_token_timeout_s == 5.0
    assert scope.telemetry.options.flush_interval_s == 0.25


@pytest.mark.parametrize(
    ("key", "value", "reason"),
    [
        ("LLM__QWEN__1__TRUST_ENV", "sometimes", "must be true or false"),
        ("LLM__QWEN__1__RPM", "2.5", "must be an integer"),
        ("LLM__CACHE__MAX_ENTRIES", "2.5", "must be an integer"),
        ("LLM__RETRY__MAX_DELAY_S", "later", "must be a number of seconds"),
        ("LLM__TELEMETRY__FLUSH_INTERVAL_S", "later", "must be a number of seconds"),
    ],
)
def test_core_and_component_keys_refuse_alike(key: str, value: str, reason: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_scope("LLM", {**SOURCE, key: value})
    assert f"{key}: {reason}" in str(excinfo.value)
    assert f"got {value!r}" in str(excinfo.value)


def _literal_kinds(method: Any) -> dict[str, Any]:
    hints = {}
    for overload in typing.get_overloads(method):
        annotations = typing.get_type_hints(overload, include_extras=False, localns=_localns())
        kind = annotations["kind"]
        if typing.get_origin(kind) is typing.Literal:
            hints[typing.get_args(kind)[0]] = annotations["return"]
    return hints


def _localns() -> dict[str, Any]:
    import argparse
    from collections.abc import Callable, Mapping

    from polygateway import plugins, ports
    from polygateway.settings import SourceConfig

    names = {n: getattr(ports, n) for n in dir(ports) if not n.startswith("_")}
    names.update({n: getattr(plugins, n) for n in dir(plugins) if n.endswith("Factory")})
    names.update(argparse=argparse, Callable=Callable, Mapping=Mapping, SourceConfig=SourceConfig)
    return names


def test_every_kind_has_a_typed_get() -> None:
    typed = _literal_kinds(Registry.get)
    assert set(KINDS) <= set(typed)  # a new kind needs its overload
    assert typed["provider"].__name__ == "ProviderProfile"


def test_every_built_kind_has_a_typed_build() -> None:
    typed = _literal_kinds(Registry.build)
    # Everything but what is made per source (transports of every call kind), profiles,
    # commands and telemetry readers (called by the report) is built from a ComponentContext.
    not_built = {
        "transport", "embedding_transport", "ocr_transport", "provider", "command",
        "telemetry_reader",
    }  # fmt: skip
    built = set(KINDS) - not_built
    assert set(typed) == built
    assert typed["limiter"].__name__ == "RateLimiter"


def test_an_options_repr_hides_credentials_even_in_plain_string_fields() -> None:
    from polygateway.options import ComponentOptions, SecretText

    class Options(ComponentOptions):
        password: str
        endpoint: str
        token: SecretText
        retries: int = 2

    secret = "s3cr3t-repr"
    options = Options(password=secret, endpoint=f"https://u:{secret}@h/", token=secret)
    for shown in (repr(options), str(options)):
        assert secret not in shown
        assert "retries=2" in shown
    assert options.token.reveal() == secret and options.password == secret
