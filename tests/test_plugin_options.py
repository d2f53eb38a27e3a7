"""Plugin-owned options: a third-party distribution registers a limiter with its own options
model and gets exactly what a builtin gets: the same validation and problem lines, the same
``pgw config check`` output, the validated model in its factory. The core names no plugin."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from plugin_dists import install_fake_plugin
from polygateway.cli import main
from polygateway.clock import SystemClock
from polygateway.config import load_scope, load_settings
from polygateway.errors import ConfigError, PluginError
from polygateway.plugins import KINDS, load_registry
from polygateway.ports import BuildContext

SECRET = "s3cr3t-SENTINEL-tollgate"

TOLLGATE_PLUGIN_SOURCE = """
from typing import Annotated

from pydantic import AfterValidator

from polygateway import hookimpl
from polygateway.backends.memory.limiter import InMemoryLimiter
from polygateway.options import (
    Bool, ComponentOptions, EnvKey, PositiveDuration, PositiveInt, SecretText,
)


def _https(value):
    if not value.reveal().startswith("https://"):
        raise ValueError("must be an https:// URL (value not shown: it may hold a token)")
    return value


class TollgateOptions(ComponentOptions):
    endpoint: Annotated[SecretText, EnvKey("TOLLGATE_ENDPOINT"), AfterValidator(_https)]
    window_s: PositiveDuration = 60.0
    max_inflight: PositiveInt = 8
    strict: Bool = False


class TollgateLimiter(InMemoryLimiter):
    def __init__(self, options, **kwargs):
        super().__init__(**kwargs)
        self.options = options


@hookimpl
def pgw_register_limiters(register):
    def tollgate(ctx):
        return TollgateLimiter(
            ctx.options,
            global_limits=ctx.settings.global_limits,
            lease_ttl_s=ctx.settings.lease_ttl_s,
            clock=ctx.clock,
        )

    def not_a_limiter(ctx):
        return object()

    class SyncLimiter(InMemoryLimiter):
        def try_acquire(self, source, est_tokens, limits):  # not async: refused at assembly
            return None

    def sync_limiter(ctx):
        return SyncLimiter(
            global_limits=ctx.settings.global_limits,
            lease_ttl_s=ctx.settings.lease_ttl_s,
            clock=ctx.clock,
        )

    register("tollgate", tollgate, options=TollgateOptions)
    register("tollgate-broken", not_a_limiter)
    register("tollgate-sync", sync_limiter)
"""

SOURCE = {"LLM__QWEN__1__BASE_URL": "http://127.0.0.1:9/v1", "LLM__QWEN__1__MODEL": "m"}
TOLLGATE = {
    "PGW_LIMITER_BACKEND": "tollgate",
    "TOLLGATE_ENDPOINT": f"https://u:{SECRET}@tollgate.example/",
}


@pytest.fixture
def tollgate_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    install_fake_plugin(site, "pgw-tollgate-example", "tollgate", TOLLGATE_PLUGIN_SOURCE)
    monkeypatch.setenv("PGW_PLUGINS", "tollgate")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)  # no stray ./.env or ./pgw.toml
    return site


def env_of(**keys: str) -> dict[str, str]:
    return {**SOURCE, "PGW_PLUGINS": "tollgate", **keys}


def problems(env: dict[str, str], **kwargs: Any) -> list[str]:
    with pytest.raises(ConfigError) as excinfo:
        load_settings(env, **kwargs)
    return list(excinfo.value.problems)


def reason(lines: list[str], key: str) -> str:
    """The text after ``<key>: `` of the one line about ``key``."""
    found = [line[len(key) + 2 :] for line in lines if line.startswith(key + ": ")]
    assert len(found) == 1, f"{key}: {lines}"
    return found[0]


def test_the_plugin_registers_its_model(tollgate_site: Path) -> None:
    registry = load_registry(allowed=["tollgate"])
    model = registry.options_of("limiter", "tollgate")
    assert model is not None and model.__name__ == "TollgateOptions"
    assert registry.provider_of("limiter", "tollgate") == "pgw-tollgate-example"
    assert registry.options_of("limiter", "memory") is None  # no model: a plain mapping
    assert registry.options_of("cache", "memory") is not None  # builtins declare theirs too


@pytest.mark.parametrize(
    ("plugin_key", "builtin_key", "value"),
    [
        ("LLM__LIMITER__MAX_INFLIGHT", "LLM__CACHE__MAX_ENTRIES", "0"),
        ("LLM__LIMITER__MAX_INFLIGHT", "LLM__CACHE__MAX_ENTRIES", "many"),
        ("LLM__LIMITER__MAX_INFLIGHT", "LLM__CACHE__MAX_ENTRIES", "8.5"),
        ("LLM__LIMITER__WINDOW_S", "LLM__TELEMETRY__FLUSH_INTERVAL_S", "0"),
        ("LLM__LIMITER__WINDOW_S", "LLM__TELEMETRY__FLUSH_INTERVAL_S", "soon"),
        ("LLM__LIMITER__WINDOW_S", "LLM__TELEMETRY__FLUSH_INTERVAL_S", "inf"),
        ("LLM__LIMITER__WINDOW_S", "LLM__TELEMETRY__FLUSH_INTERVAL_S", "-2s"),
    ],
)
def test_a_plugin_option_is_judged_like_a_builtin_one(
    tollgate_site: Path, plugin_key: str, builtin_key: str, value: str
) -> None:
    found = problems(env_of(**TOLLGATE, **{plugin_key: value, builtin_key: value}))
    assert reason(found, plugin_key) == reason(found, builtin_key)
    assert f"got {value!r}" in reason(found, plugin_key)


def test_unknown_options_list_the_allowed_ones_for_both(
    tollgate_site: Path, tmp_path: Path
) -> None:
    path = tmp_path / "pgw.toml"
    path.write_text(
        "[scopes.LLM.limiter.options]\nmaxinflight = 3\n"
        "[scopes.LLM.cache.options]\nmaxentries = 3\n",
        encoding="utf-8",
    )
    found = problems(env_of(**TOLLGATE), pipeline_path=path)
    plugin = reason(found, f"{path}:[scopes.LLM.limiter.options].maxinflight")
    builtin = reason(found, f"{path}:[scopes.LLM.cache.options].maxentries")
    assert plugin == (
        "unknown key (did you mean max_inflight?); "
        "allowed: endpoint, max_inflight, strict, window_s"
    )
    assert builtin == "unknown key (did you mean max_entries?); allowed: max_entries"


def test_the_plugin_flat_key_is_required_and_checked_without_the_core_knowing_it(
    tollgate_site: Path,
) -> None:
    found = problems(env_of(PGW_LIMITER_BACKEND="tollgate"))
    assert found == [
        "TOLLGATE_ENDPOINT: required because PGW_LIMITER_BACKEND=tollgate selects tollgate "
        "for the limiter"
    ]
    bad = problems(env_of(TOLLGATE_ENDPOINT=f"http://u:{SECRET}@tollgate.example/"))
    assert bad == [
        "TOLLGATE_ENDPOINT: must be an https:// URL (value not shown: it may hold a token)"
    ]
    assert SECRET not in " ".join(bad)


def test_the_factory_gets_the_validated_model(tollgate_site: Path) -> None:
    from polygateway import GatewayClient

    env = env_of(**TOLLGATE, LLM__LIMITER__WINDOW_S="2m", LLM__LIMITER__STRICT="on")
    scope = load_scope("LLM", env)
    options = scope.limiter.options
    assert (options.window_s, options.strict, options.max_inflight) == (120.0, True, 8)
    assert SECRET not in repr(scope) and SECRET not in repr(options)
    client = GatewayClient.from_env("LLM", env=env)
    try:
        limiter: Any = client._components.limiter
        assert type(limiter).__name__ == "TollgateLimiter"
        assert limiter.options is options or limiter.options == options
        assert limiter.options.endpoint.reveal() == TOLLGATE["TOLLGATE_ENDPOINT"]
    finally:
        import asyncio

        asyncio.run(client.aclose())


def test_hand_built_settings_are_validated_by_the_same_model(tollgate_site: Path) -> None:
    registry = load_registry(allowed=["tollgate"])
    settings = load_scope("LLM", SOURCE)
    ctx = BuildContext(settings=settings, options={"window_s": "0"}, clock=SystemClock())
    with pytest.raises(ConfigError) as caught:
        registry.build("limiter", "tollgate", ctx)
    assert sorted(caught.value.problems) == [
        "limiter 'tollgate' option endpoint: required (env TOLLGATE_ENDPOINT)",
        "limiter 'tollgate' option window_s: must be > 0, got '0'",
    ]


def test_a_factory_returning_the_wrong_thing_fails_at_assembly_naming_the_plugin(
    tollgate_site: Path,
) -> None:
    registry = load_registry(allowed=["tollgate"])
    ctx = BuildContext(settings=load_scope("LLM", SOURCE), options={}, clock=SystemClock())
    with pytest.raises(PluginError) as caught:
        registry.build("limiter", "tollgate-broken", ctx)
    message = str(caught.value)
    assert "limiter 'tollgate-broken' (plugin pgw-tollgate-example)" in message
    assert "not a RateLimiter" in message and "try_acquire" in message
    with pytest.raises(PluginError, match=r"pgw-tollgate-example.*try_acquire must be async def"):
        registry.build("limiter", "tollgate-sync", ctx)
    from polygateway import GatewayClient

    with pytest.raises(PluginError, match="pgw-tollgate-example"):
        GatewayClient.from_env("LLM", env=env_of(PGW_LIMITER_BACKEND="tollgate-broken"))


def _check_output(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(["config", "check", *args]) == 0
    captured = capsys.readouterr()
    assert SECRET not in captured.out + captured.err
    return captured.out


def test_config_check_shows_plugin_options_like_builtin_ones(
    tollgate_site: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for key, value in {**SOURCE, **TOLLGATE, "LLM__LIMITER__MAX_INFLIGHT": "3"}.items():
        monkeypatch.setenv(key, value)
    described = json.loads(_check_output(capsys, "--json"))["scopes"]["LLM"]
    assert described["limiter"] == {
        "name": "tollgate",
        "options": {
            "endpoint": "https://u:***@tollgate.example/",
            "window_s": 60.0,
            "max_inflight": 3,
            "strict": False,
        },
    }
    assert described["telemetry"]["options"] == {
        "batch_size": 2048,
        "flush_interval_s": 0.2,
        "queue_max": 100000,
    }
    lines = _check_output(capsys).splitlines()
    limiter = lines.index("  limiter:")
    assert lines[limiter : limiter + 7] == [
        "  limiter:",
        "    name: tollgate",
        "    options:",
        "      endpoint: https://u:***@tollgate.example/",
        "      window_s: 60.0",
        "      max_inflight: 3",
        "      strict: false",
    ]
    telemetry = lines.index("  telemetry:")
    assert lines[telemetry + 3 : telemetry + 5] == ["    options:", "      batch_size: 2048"]


def _names_in_code(path: Path) -> set[str]:
    """Identifiers and string constants of a module; docstrings (any bare string statement,
    attribute docstrings included) left out: prose may mention a plugin, code may not."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) not in docstrings:
                found.add(node.value)
        elif isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found.add(node.name)
    return found


def test_no_line_of_the_core_names_a_plugin() -> None:
    core = Path(__file__).resolve().parents[1] / "polygateway-core" / "src" / "polygateway"
    named: dict[str, list[str]] = {}
    for path in sorted(core.rglob("*.py")):
        for text in _names_in_code(path):
            lowered = text.lower()
            for plugin_word in ("tollgate", "redis", "postgres", "pg_dsn", "monkeyocr"):
                if plugin_word in lowered:
                    named.setdefault(str(path.relative_to(core)), []).append(text)
    assert named == {}


def test_a_provider_that_is_not_a_profile_fails_at_assembly_naming_the_plugin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from polygateway import GatewayClient, hookimpl

    monkeypatch.chdir(tmp_path)

    class BadProfile:
        @hookimpl
        def pgw_register_providers(self, register: Any) -> None:
            register("acme", {"thinking": True})  # a dict, not a ProviderProfile

    registry = load_registry(autoload=False, extra_plugins=[("pgw-acme", BadProfile())])
    settings = load_scope("LLM", SOURCE)
    with pytest.raises(PluginError, match=r"provider 'acme' \(plugin pgw-acme\).*ProviderProfile"):
        GatewayClient(settings, registry=registry)


@pytest.mark.skipif(
    "ocr_transport" not in KINDS, reason="needs the OCR transport hook (call kinds branch)"
)
def test_an_ocr_transport_needs_one_of_the_ocr_ports() -> None:
    from polygateway import hookimpl
    from polygateway.settings import SourceConfig

    class TextOnly:
        async def recognize_text(self, image: bytes) -> Any: ...

        async def check_health(self) -> bool:
            return True

        async def aclose(self) -> None: ...

    class Neither:
        async def aclose(self) -> None: ...

    class Ocr:
        @hookimpl
        def pgw_register_ocr_transports(self, register: Any) -> None:
            register("text-only", lambda source: TextOnly())
            register("neither", lambda source: Neither())

    registry = load_registry(autoload=False, extra_plugins=[("pgw-ocr-example", Ocr())])
    source = SourceConfig(name="o", provider="generic", base_url="http://127.0.0.1:9", model="m")
    assert isinstance(registry.build_source_port("ocr_transport", "text-only", source), TextOnly)
    with pytest.raises(PluginError, match=r"ocr_transport 'neither' \(plugin pgw-ocr-example\)"):
        registry.build_source_port("ocr_transport", "neither", source)


def test_a_registered_non_factory_fails_at_build_naming_the_plugin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from polygateway import hookimpl

    monkeypatch.chdir(tmp_path)

    class NotAFactory:
        @hookimpl
        def pgw_register_caches(self, register: Any) -> None:
            register("strings", "not a factory")

    registry = load_registry(autoload=False, extra_plugins=[("pgw-strings", NotAFactory())])
    ctx = BuildContext(settings=load_scope("LLM", SOURCE), options={}, clock=SystemClock())
    with pytest.raises(PluginError, match=r"cache 'strings' \(plugin pgw-strings\).*non-callable"):
        registry.build("cache", "strings", ctx)


async def test_any_call_kind_builds_its_governance_parts_through_the_registry(
    tollgate_site: Path,
) -> None:
    from polygateway.assembly import build_governance
    from polygateway.backends.memory.breaker import InMemoryGate

    env = env_of(**TOLLGATE, LLM__LIMITER__MAX_INFLIGHT="2", PGW_TELEMETRY_BACKEND="none")
    settings = load_scope("LLM", env)
    registry = load_registry(allowed=["tollgate"])
    mine = InMemoryGate(fail_threshold=1, cooldown_s=1.0, probe_ttl_s=10.0, clock=SystemClock())
    parts = build_governance(settings, registry, clock=SystemClock(), breaker=mine)
    assert type(parts.limiter).__name__ == "TollgateLimiter"
    assert parts.limiter.options.max_inflight == 2  # type: ignore[attr-defined]
    assert parts.breaker is mine and parts.telemetry is None and parts.pricing is None
    assert parts.built == {"limiter", "selector", "pricing"}  # the injected breaker is not ours
    await parts.limiter.aclose()
    broken = dataclasses.replace(
        settings, limiter=dataclasses.replace(settings.limiter, name="tollgate-broken")
    )
    with pytest.raises(PluginError, match="pgw-tollgate-example"):
        build_governance(broken, registry, clock=SystemClock())
