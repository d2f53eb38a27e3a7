"""``pgw config check`` and ``from_env`` agree, and both catch mistakes (real CLI, subprocess).

Every test runs ``python -m polygateway`` (or a ``python -c`` calling ``from_env``) in a fresh
directory with an environment stripped of configuration keys, so ``.env`` and ``pgw.toml``
there are the only other origins.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from plugin_dists import GOOD_PLUGIN_SOURCE, install_fake_plugin

REPO = Path(__file__).resolve().parents[2]
CONFIG_KEY = re.compile(r"^[A-Z][A-Z0-9_]*__|^(LLM|PGW)_|^REDIS_URL$")
SOURCE = {
    "LLM__OPENAI__1__BASE_URL": "http://127.0.0.1:9/v1",
    "LLM__OPENAI__1__MODEL": "gpt-test",
    "LLM__OPENAI__1__MAX_CONCURRENCY": "8",
}

LAZY_LIMITER_SOURCE = """
from polygateway import hookimpl


@hookimpl
def pgw_register_limiters(register):
    def lazy(ctx):
        import {module}  # noqa: F401  (deferred like pgw-redis defers ``redis``)

    register("{name}", lazy)
"""

FROM_ENV = """
import sys
from polygateway import GatewayClient, PluginError, ConfigError
try:
    GatewayClient.from_env("LLM")
except PluginError as exc:
    print("PluginError"); print("\\n".join(exc.problems)); sys.exit(3)
except ConfigError as exc:
    print("ConfigError"); print("\\n".join(exc.problems)); sys.exit(4)
print("built")
"""


def clean_env(site: Path | None = None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not CONFIG_KEY.search(k)}
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def pgw(cwd: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "polygateway", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def python(cwd: Path, code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def line_with(text: str, *needles: str) -> str:
    found = [line for line in lines(text) if all(n in line for n in needles)]
    assert found, f"no line contains {needles}:\n{text}"
    return found[0]


# --------------------------------------------------------------------------- typos


@pytest.mark.parametrize(
    ("key", "meant"),
    [
        ("LLM_TIMOUT", "LLM_TIMEOUT"),
        ("LLM_MAX_RETRIS", "LLM_MAX_RETRIES"),
        ("PGW_CACHE_TTL", "PGW_CACHE_TTL_S"),
        ("PGW_CACHE_NAMSPACE", "PGW_CACHE_NAMESPACE"),
        ("PGW_STATE_BACKENDS", "PGW_STATE_BACKEND"),
        ("LLM__RETRI__MAX_ATTEMPTS", "LLM__RETRY__MAX_ATTEMPTS"),
        ("LLM__OPENAI__1__TIMOUT_S", "TIMEOUT_S"),
    ],
)
@pytest.mark.parametrize("origin", ["env", "dotenv"])
def test_a_typo_is_an_error_with_a_suggestion(
    tmp_path: Path, key: str, meant: str, origin: str
) -> None:
    values = {**SOURCE, key: "3"}
    if origin == "env":
        env = clean_env(PGW_PLUGINS="", **values)
    else:
        env = clean_env(PGW_PLUGINS="")
        (tmp_path / ".env").write_text(
            "".join(f"{k}={v}\n" for k, v in values.items()), encoding="utf-8"
        )
    result = pgw(tmp_path, "config", "check", env=env)
    assert result.returncode == 2, result.stdout
    assert f"did you mean {meant}?" in line_with(result.stderr, f"pgw: {key}:")
    # from_env refuses the same key the same way.
    built = python(tmp_path, FROM_ENV, env)
    assert built.returncode == 4, built.stdout + built.stderr
    assert f"did you mean {meant}?" in line_with(built.stdout, f"{key}:")


def test_a_typo_in_the_pipeline_file_suggests_the_key(tmp_path: Path) -> None:
    (tmp_path / "pgw.toml").write_text(
        "[scopes.LLM]\nselectr = 'round_robin'\n[scopes.LLM.cache]\nnamspace = 'x'\n"
        "[[scopes.LLM.sources]]\nprovider = 'openai'\nbase_url = 'http://127.0.0.1:9/v1'\n"
        "model = 'm'\ntimout_s = 3\n",
        encoding="utf-8",
    )
    result = pgw(tmp_path, "config", "check", env=clean_env(PGW_PLUGINS=""))
    assert result.returncode == 2
    for key, meant in [
        ("pgw.toml:[scopes.LLM].selectr", "selector"),
        ("pgw.toml:[scopes.LLM.cache].namspace", "namespace"),
        ("pgw.toml:[scopes.LLM.sources[0]].timout_s", "timeout_s"),
    ]:
        assert f"unknown key (did you mean {meant}?)" in line_with(result.stderr, f"pgw: {key}:")


def test_keys_plugins_declare_are_known(tmp_path: Path) -> None:
    # REDIS_URL is pgw-redis's (its options model declares it): no "unknown key" for it, and
    # a non-PolyGateway key under no configured prefix is left alone.
    env = clean_env(**SOURCE, REDIS_URL="redis://127.0.0.1:6379/3", OTHER_TOOL_X="1")
    result = pgw(tmp_path, "config", "check", env=env)
    assert result.returncode == 0, result.stderr
    assert "unknown key" not in result.stderr


OTHER_TOOLS = {"LLM_USER_PATH": "/home/me/.llm", "LLM_LOG_LEVEL": "debug", "JUDGE_MODE": "x"}
SCOPE_KEYS = {"JUDGE__OPENAI__1__BASE_URL": "http://127.0.0.1:9/v1", "JUDGE__OPENAI__1__MODEL": "m"}


def test_other_tools_keys_under_a_scope_prefix_are_errors_until_listed(tmp_path: Path) -> None:
    env = clean_env(PGW_PLUGINS="", **SOURCE, **SCOPE_KEYS, **OTHER_TOOLS, LLM_TIMOUT="3")
    result = pgw(tmp_path, "config", "check", env=env)
    assert result.returncode == 2
    for key in [*OTHER_TOOLS, "LLM_TIMOUT"]:
        found = line_with(result.stderr, f"pgw: {key}: unknown key")
        assert "list it in PGW_CONFIG_IGNORE_KEYS" in found
    # JUDGE has no flat keys of its own: the problem says how JUDGE is set instead.
    assert "scope JUDGE is set with JUDGE__... keys" in line_with(result.stderr, "JUDGE_MODE")
    built = python(tmp_path, FROM_ENV, env)
    assert built.returncode == 4 and "LLM_USER_PATH: unknown key" in built.stdout

    # Listed (names or patterns): no longer errors; a typo among them is still caught.
    ignore = "LLM_USER_PATH, LLM_LOG_*,JUDGE_MODE"
    listed = {**env, "PGW_CONFIG_IGNORE_KEYS": ignore}
    result = pgw(tmp_path, "config", "check", "--json", env=listed)
    assert result.returncode == 2
    errors = json.loads(result.stdout)["errors"]
    assert len(errors) == 1 and errors[0].startswith("LLM_TIMOUT: unknown key (did you mean")
    built = python(tmp_path, FROM_ENV, listed)
    assert built.returncode == 4
    assert lines(built.stdout)[1:] == errors  # from_env says exactly what the check says

    clean = {k: v for k, v in listed.items() if k != "LLM_TIMOUT"}
    assert pgw(tmp_path, "config", "check", env=clean).returncode == 0
    assert python(tmp_path, FROM_ENV, clean).stdout.strip() == "built"


@pytest.mark.parametrize("origin", ["dotenv", "file"])
def test_the_ignore_list_is_read_from_dotenv_and_the_pipeline_file(
    tmp_path: Path, origin: str
) -> None:
    env = clean_env(PGW_PLUGINS="", **SOURCE, LLM_USER_PATH="/x", LLM__TOOL_SETTING="y")
    if origin == "dotenv":
        (tmp_path / ".env").write_text(
            "PGW_CONFIG_IGNORE_KEYS=LLM_USER_PATH,LLM__TOOL_*\n", encoding="utf-8"
        )
    else:
        (tmp_path / "pgw.toml").write_text(
            'ignore_keys = ["LLM_USER_PATH", "LLM__TOOL_*"]\n', encoding="utf-8"
        )
    result = pgw(tmp_path, "config", "check", env=env)
    assert result.returncode == 0, result.stderr
    assert python(tmp_path, FROM_ENV, env).stdout.strip() == "built"
    # The environment wins over the file, as for every key: an empty list ignores nothing.
    stricter = {**env, "PGW_CONFIG_IGNORE_KEYS": ""}
    result = pgw(tmp_path, "config", "check", env=stricter)
    assert result.returncode == 2
    assert "LLM_USER_PATH: unknown key" in result.stderr
    assert "LLM__TOOL_SETTING: not a PolyGateway key" in result.stderr


def test_a_bad_ignore_list_is_an_error_naming_its_key(tmp_path: Path) -> None:
    env = clean_env(PGW_PLUGINS="", **SOURCE, PGW_CONFIG_IGNORE_KEYS="LLM_USER_PATH,bad key")
    result = pgw(tmp_path, "config", "check", env=env)
    assert result.returncode == 2
    assert "PGW_CONFIG_IGNORE_KEYS: 'bad key' is not a key name or pattern" in result.stderr
    (tmp_path / "pgw.toml").write_text('ignore_keys = "LLM_USER_PATH"\n', encoding="utf-8")
    result = pgw(tmp_path, "config", "check", env=clean_env(PGW_PLUGINS="", **SOURCE))
    assert result.returncode == 2
    assert "pgw.toml:ignore_keys: must be a list of env key names" in result.stderr


def test_only_the_prefixes_of_configured_scopes_are_checked(tmp_path: Path) -> None:
    # No scope named OPENAI or JUDGE: their keys are other tools'. PGW_* is always checked.
    env = clean_env(PGW_PLUGINS="", **SOURCE, OPENAI_API_KEY="sk-x", JUDGE_MODE="x", JUDGE__FOO="y")
    result = pgw(tmp_path, "config", "check", env=env)
    assert result.returncode == 0, result.stderr
    assert "unknown key" not in result.stderr
    typo = pgw(tmp_path, "config", "check", env={**env, "PGW_CACHE_BACKENDS": "memory"})
    assert "did you mean PGW_CACHE_BACKEND?" in line_with(typo.stderr, "PGW_CACHE_BACKENDS")


# --------------------------------------------------------------------------- plugins


@pytest.fixture
def site(tmp_path: Path) -> Path:
    folder = tmp_path / "site"
    folder.mkdir()
    install_fake_plugin(
        folder,
        "pgw-lazy-example",
        "lazy",
        LAZY_LIMITER_SOURCE.format(module="pgw_lazy_dependency_module", name="lazy"),
        requires=("pgw-lazy-dependency-that-is-not-installed>=1.0",),
    )
    install_fake_plugin(
        folder,
        "pgw-late-example",
        "late",
        LAZY_LIMITER_SOURCE.format(module="pgw_late_module_not_installed", name="late"),
    )
    install_fake_plugin(
        folder,
        "pgw-good-example",
        "good",
        GOOD_PLUGIN_SOURCE.format(transport="good-transport", command="hello"),
    )
    return folder


def test_a_plugin_missing_a_dependency_is_failed_with_the_hint(tmp_path: Path, site: Path) -> None:
    result = pgw(tmp_path, "plugins", "list", "--json", env=clean_env(site))
    assert result.returncode == 0, result.stderr
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    lazy = rows["pgw-lazy-example"]
    assert lazy["status"] == "failed"
    assert lazy["provides"] == {}
    assert "missing dependency pgw-lazy-dependency-that-is-not-installed>=1.0" in lazy["error"]
    assert lazy["hint"] == "pip install 'pgw-lazy-dependency-that-is-not-installed>=1.0'"
    table = pgw(tmp_path, "plugins", "list", env=clean_env(site)).stdout
    assert "hint: pip install 'pgw-lazy-dependency-that-is-not-installed>=1.0'" in table
    assert "ModuleNotFoundError: missing dependency" in line_with(table, "error:")

    env = clean_env(site, **SOURCE, PGW_LIMITER_BACKEND="lazy")
    check = pgw(tmp_path, "config", "check", env=env)
    assert check.returncode == 2
    line = line_with(check.stderr, "pgw: PGW_LIMITER_BACKEND: limiter 'lazy' is not registered")
    assert "plugin pgw-lazy-example (entry point 'lazy') failed to load" in line
    assert "try: pip install 'pgw-lazy-dependency-that-is-not-installed>=1.0'" in line
    built = python(tmp_path, FROM_ENV, env)
    assert built.returncode == 3, built.stdout + built.stderr  # PluginError
    assert "Traceback" not in built.stderr
    assert line_with(built.stdout, "PGW_LIMITER_BACKEND:") == line.removeprefix("pgw: ")


def test_a_dependency_imported_late_is_a_plugin_error(tmp_path: Path, site: Path) -> None:
    # No declared dependency to check at load: the factory's import fails at assembly, and
    # from_env turns it into a PluginError naming the plugin and the module.
    env = clean_env(site, **SOURCE, PGW_LIMITER_BACKEND="late")
    built = python(tmp_path, FROM_ENV, env)
    assert built.returncode == 3, built.stdout + built.stderr
    assert "Traceback" not in built.stderr
    assert "limiter 'late' (plugin pgw-late-example): needs module " in built.stdout
    assert "pip install pgw_late_module_not_installed" in built.stdout


@pytest.mark.parametrize("origin", ["env", "dotenv", "file"])
def test_pgw_plugins_is_read_alike_by_the_cli_and_from_env(
    tmp_path: Path, site: Path, origin: str
) -> None:
    # The only transport named is the good plugin's; leaving the plugin out must fail both.
    values = {**SOURCE, "LLM__OPENAI__1__TRANSPORT": "good-transport"}
    env = clean_env(site, **values)
    if origin == "env":
        env["PGW_PLUGINS"] = "lazy"
    elif origin == "dotenv":
        (tmp_path / ".env").write_text("PGW_PLUGINS=lazy\n", encoding="utf-8")
    else:
        (tmp_path / "pgw.toml").write_text('plugins = ["lazy"]\n', encoding="utf-8")
    listing = json.loads(pgw(tmp_path, "plugins", "list", "--json", env=env).stdout)
    assert "pgw-good-example" not in {row["name"] for row in listing}
    check = pgw(tmp_path, "config", "check", env=env)
    assert check.returncode == 2
    line = line_with(check.stderr, "transport 'good-transport' is not registered")
    assert "pgw-good-example" in line.split("not in PGW_PLUGINS): ", 1)[1]
    built = python(tmp_path, FROM_ENV, env)
    assert built.returncode in (3, 4)
    assert line_with(built.stdout, "good-transport") == line.removeprefix("pgw: ")
    # Env wins over .env and the file, as for every key.
    env["PGW_PLUGINS"] = "good"
    assert pgw(tmp_path, "config", "check", env=env).returncode == 0
    # from_env now gets the plugin's transport (a stub that is no real Transport: refused).
    built = python(tmp_path, FROM_ENV, env)
    assert "transport 'good-transport' (plugin pgw-good-example): its factory returned" in (
        built.stdout
    )


# --------------------------------------------------------------------------- no configuration


def test_no_configuration_at_all_fails_and_says_what_to_set(tmp_path: Path) -> None:
    env = clean_env(PGW_PLUGINS="")
    result = pgw(tmp_path, "config", "check", env=env)
    assert result.returncode == 2
    assert "configuration OK" not in result.stdout
    line = line_with(result.stderr, "pgw: no scope is configured")
    assert "LLM__OPENAI__1__BASE_URL" in line and "[[scopes.LLM.sources]]" in line
    as_json = pgw(tmp_path, "config", "check", "--json", env=env)
    assert as_json.returncode == 2
    report = json.loads(as_json.stdout)
    assert report["ok"] is False and report["scopes"] == {}
    assert report["errors"][0].startswith("no scope is configured")


def test_json_carries_errors_and_warnings(tmp_path: Path) -> None:
    env = clean_env(PGW_PLUGINS="", **SOURCE, LLM_TIMOUT="3", SUMMARY__RETRY__MAX_ATTEMPTS="2")
    report = json.loads(pgw(tmp_path, "config", "check", "--json", env=env).stdout)
    assert report["ok"] is False
    assert any(e.startswith("LLM_TIMOUT: unknown key") for e in report["errors"])
    env.pop("LLM_TIMOUT")
    result = pgw(tmp_path, "config", "check", "--json", env=env)
    report = json.loads(result.stdout)
    assert result.returncode == 0 and report["ok"] is True and report["errors"] == []
    warnings = report["warnings"]
    assert any(w.startswith("SUMMARY: scope has settings but no sources") for w in warnings)


# --------------------------------------------------------------------------- pricing


def test_the_pricing_file_is_loaded_and_validated(tmp_path: Path) -> None:
    example = REPO / "docs" / "pricing.example.json"
    env = clean_env(PGW_PLUGINS="", **SOURCE, PGW_PRICING_PATH=str(example))
    result = pgw(tmp_path, "config", "check", env=env)
    assert result.returncode == 0, result.stderr
    assert f"pricing_path: {example}" in result.stdout
    bad = tmp_path / "prices.json"
    bad.write_text('{"gpt-test": {"input_per_1m": 1, "output_per_1m": -2}}', encoding="utf-8")
    env["PGW_PRICING_PATH"] = str(bad)
    result = pgw(tmp_path, "config", "check", env=env)
    assert result.returncode == 2
    assert "field 'output_per_1m' must be a finite number >= 0, got -2" in line_with(
        result.stderr, "pgw: PGW_PRICING_PATH / pricing_path: pricing file"
    )
    env["PGW_PRICING_PATH"] = str(tmp_path / "missing.json")
    assert "not found" in pgw(tmp_path, "config", "check", env=env).stderr


# --------------------------------------------------------------------------- derived values


def test_effective_values_are_shown(tmp_path: Path) -> None:
    env = clean_env(PGW_PLUGINS="", **SOURCE, LLM__OPENAI__1__TIMEOUT_S="60")
    result = pgw(tmp_path, "config", "check", env=env)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    # fail_threshold 5, max_concurrency 8: the breaker opens after max(5, 2 x 8) = 16.
    assert "      openai-1: 16" in out
    assert "breaker_fail_threshold_rule: max(configured 5, 2 x the source's max_concurrency)" in out
    assert "lease_ttl_s: 90.0" in out
    assert "lease_ttl: derived: longest source timeout 60 + 30" in out
    assert "probe_ttl_s: 120.0" in out
    report = json.loads(pgw(tmp_path, "config", "check", "--json", env=env).stdout)
    effective = report["scopes"]["LLM"]["effective"]
    assert effective["breaker_fail_threshold"] == {"openai-1": 16}
    assert (effective["lease_ttl_s"], effective["probe_ttl_s"]) == (90.0, 120.0)


def test_errors_name_the_key_the_user_set(tmp_path: Path) -> None:
    env = clean_env(PGW_PLUGINS="", **SOURCE, LLM_TTFT_TIMEOUT="200")
    result = pgw(tmp_path, "config", "check", env=env)
    assert result.returncode == 2
    line = line_with(result.stderr, "pgw: LLM_TTFT_TIMEOUT: 200 must be < TIMEOUT_S 120")
    assert "the default; set LLM__OPENAI__1__TIMEOUT_S to change it" in line
    (tmp_path / "pgw.toml").write_text(
        "[scopes.LLM.backpressure]\nlease_ttl_s = 10\n", encoding="utf-8"
    )
    result = pgw(tmp_path, "config", "check", env=clean_env(PGW_PLUGINS="", **SOURCE))
    assert line_with(result.stderr, "lease TTL 10").startswith(
        "pgw: pgw.toml:[scopes.LLM.backpressure].lease_ttl_s: "
    )


def test_the_documented_pricing_format_is_what_loads() -> None:
    from polygateway.telemetry.pricing import PricingTable

    doc = (REPO / "docs" / "usage.md").read_text(encoding="utf-8")
    block = doc.split("## Pricing", 1)[1].split("```json\n", 1)[1].split("```", 1)[0]
    table = PricingTable(json.loads(block), origin="docs/usage.md")
    assert table.currency == "USD"
    price = table.price("claude-sonnet")
    assert price is not None and price.cached_input_per_1m == 0.3
    # 1M prompt tokens of which 0.5M were cached, 0.1M completion.
    assert table.cost("claude-sonnet", 1_000_000, 100_000, cached_tokens=500_000) == (
        pytest.approx(0.5 * 3.0 + 0.5 * 0.3 + 0.1 * 15.0)
    )
    example = PricingTable.from_file(str(REPO / "docs" / "pricing.example.json"))
    assert example.currency == "USD" and "gpt-test" in example.models


def test_a_bad_engine_source_field_is_reported_by_its_key(tmp_path: Path) -> None:
    env = clean_env(PGW_PLUGINS="", **SOURCE, LLM__OPENAI__1__KEEPALIVE_S="soon")
    result = pgw(tmp_path, "config", "check", env=env)
    assert result.returncode == 2, result.stdout
    line = line_with(result.stderr, "pgw: LLM__OPENAI__1__KEEPALIVE_S:")
    assert "must be a number of seconds" in line and "soon" not in line
    fine = clean_env(PGW_PLUGINS="", **SOURCE, LLM__OPENAI__1__KEEPALIVE_S="15s")
    assert pgw(tmp_path, "config", "check", env=fine).returncode == 0
