"""The ``pgw`` command line: version, plugin listing, plugin commands, failures."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from plugin_dists import BROKEN_PLUGIN_SOURCE, GOOD_PLUGIN_SOURCE, install_fake_plugin
from polygateway import __version__
from polygateway.cli import main

JSON_KEYS = {"name", "version", "entry_point", "hooks", "provides", "status", "error", "hint"}

COMMAND_PLUGIN_SOURCE = """
from polygateway import ConfigError, hookimpl


@hookimpl
def pgw_register_commands(register):
    def broken(parser):
        import pgw_module_of_a_command_that_does_not_exist  # noqa: F401

    def strict(parser):
        def run(namespace):
            raise ConfigError(["LLM__QWEN__1__MODEL: missing", "PGW_CACHE_BACKEND: unknown 'x'"])

        return run

    register("broken-cmd", broken)
    register("strict-cmd", strict)
"""


def run_pgw(
    *args: str, plugins: str | None = "", path: Path | None = None
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("PGW_PLUGINS", None)
    if plugins is not None:
        env["PGW_PLUGINS"] = plugins
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(path), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, timeout=60, check=False
    )


@pytest.fixture
def builtin_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PGW_PLUGINS", "")


@pytest.fixture
def fake_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.syspath_prepend(str(tmp_path))
    install_fake_plugin(
        tmp_path,
        "pgw-good-example",
        "good",
        GOOD_PLUGIN_SOURCE.format(transport="good-transport", command="hello"),
    )
    install_fake_plugin(tmp_path, "pgw-broken-example", "broken", BROKEN_PLUGIN_SOURCE)
    install_fake_plugin(tmp_path, "pgw-commands-example", "commands", COMMAND_PLUGIN_SOURCE)
    monkeypatch.setenv("PGW_PLUGINS", "good,broken,commands")
    return tmp_path


# --------------------------------------------------------------------------- version


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"pgw {__version__}\n"


def test_version_loads_no_plugin() -> None:
    code = (
        "import sys; from polygateway.cli import main; rc = main(['--version']); "
        "print(rc, 'polygateway.plugins' in sys.modules)"
    )
    result = run_pgw("-c", code)
    assert result.stdout.splitlines()[-1] == "0 False", result.stderr


def test_console_script_version() -> None:
    script = Path(sys.executable).with_name("pgw")
    assert script.exists(), "polygateway-core must declare the pgw console script"
    result = subprocess.run(
        [str(script), "--version"], capture_output=True, text=True, timeout=60, check=False
    )
    assert (result.returncode, result.stdout) == (0, f"pgw {__version__}\n")


@pytest.mark.parametrize("module", ["polygateway", "polygateway.cli"])
def test_python_dash_m(module: str) -> None:
    assert run_pgw("-m", module, "--version").stdout == f"pgw {__version__}\n"
    result = run_pgw("-m", module, "plugins", "list", "--json")
    assert result.returncode == 0, result.stderr
    [core] = json.loads(result.stdout)
    assert core["name"] == "polygateway-core"
    assert core["status"] == "loaded"


# --------------------------------------------------------------------------- plugins list


def test_plugins_list_json_builtin_only(
    builtin_only: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plugins", "list", "--json"]) == 0
    [core] = json.loads(capsys.readouterr().out)
    assert set(core) == JSON_KEYS
    assert core["name"] == "polygateway-core"
    assert core["version"] == __version__
    assert core["entry_point"] == ""
    assert core["status"] == "loaded"
    assert core["error"] is None
    assert "pgw_register_transports" in core["hooks"]
    assert "openai-compat" in core["provides"]["transport"]
    assert {"plugins", "config"} <= set(core["provides"]["command"])


def test_plugins_list_table(builtin_only: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["DISTRIBUTION", "VERSION", "STATUS", "PROVIDES"]
    assert lines[1].split()[:4] == ["polygateway-core", __version__, "loaded", "transport:"]
    assert any(line.split() == ["limiter:", "memory"] for line in lines)
    # The provides column is one column: every continuation line starts where it starts.
    column = lines[0].index("PROVIDES")
    assert all(line[:column].strip() == "" for line in lines[2:])


def test_plugins_without_action_lists(
    builtin_only: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plugins"]) == 0
    assert "polygateway-core" in capsys.readouterr().out


def test_failed_plugin_is_listed_with_its_error(
    fake_site: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plugins", "list", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert set(rows) == {
        "polygateway-core",
        "pgw-good-example",
        "pgw-broken-example",
        "pgw-commands-example",
    }
    assert rows["pgw-good-example"]["status"] == "loaded"
    assert rows["pgw-good-example"]["provides"] == {
        "transport": ["good-transport"],
        "command": ["hello"],
    }
    broken = rows["pgw-broken-example"]
    assert (broken["status"], broken["entry_point"], broken["version"]) == (
        "failed",
        "broken",
        "1.2.3",
    )
    assert "pgw_test_dependency_that_is_not_installed" in broken["error"]

    assert main(["plugins", "list"]) == 0
    table = capsys.readouterr().out
    assert re.search(r"^pgw-broken-example +1\.2\.3 +failed +error: ModuleNotFound", table, re.M)
    assert "error: ModuleNotFoundError: No module named" in table
    assert "hint: pip install pgw_test_dependency_that_is_not_installed" in table


def test_pgw_plugins_env_is_honoured(
    fake_site: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PGW_PLUGINS", "pgw-good-example")
    assert main(["plugins", "list", "--json"]) == 0
    names = [row["name"] for row in json.loads(capsys.readouterr().out)]
    assert names == ["polygateway-core", "pgw-good-example"]


# --------------------------------------------------------------------------- commands


def test_plugin_adds_a_command(fake_site: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["hello", "--who", "plugins"]) == 0
    assert capsys.readouterr().out == "hello plugins\n"


def test_broken_command_fails_only_when_invoked(
    fake_site: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plugins", "list"]) == 0
    assert "pgw_module_of_a_command" not in capsys.readouterr().err

    assert main(["broken-cmd", "--anything"]) == 2
    err = capsys.readouterr().err
    assert "command 'broken-cmd' (from pgw-commands-example) is unavailable" in err
    assert "No module named 'pgw_module_of_a_command_that_does_not_exist'" in err


def test_help_lists_every_command(fake_site: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("plugins", "config", "hello", "strict-cmd"):
        assert f"\n  {name} " in out or f"\n  {name}\n" in out
    assert "Say hello from a plugin." in out
    assert "broken-cmd" in out
    assert "(unavailable" in out


def test_config_error_from_a_command_prints_one_line_per_problem(
    fake_site: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["strict-cmd"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "pgw: LLM__QWEN__1__MODEL: missing",
        "pgw: PGW_CACHE_BACKEND: unknown 'x'",
    ]


def test_unknown_command(builtin_only: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["frobnicate"]) == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'frobnicate'" in err
    assert "plugins" in err


def test_no_command_prints_help(builtin_only: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "usage: pgw" in capsys.readouterr().out


def test_conflicting_plugins_exit_2_naming_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    for dist in ("pgw-clash-a", "pgw-clash-b"):
        install_fake_plugin(
            tmp_path, dist, dist, GOOD_PLUGIN_SOURCE.format(transport="clash", command=dist)
        )
    monkeypatch.setenv("PGW_PLUGINS", "pgw-clash-a,pgw-clash-b")
    assert main(["plugins", "list"]) == 2
    err = capsys.readouterr().err
    assert "transport 'clash' is registered by both pgw-clash-a and pgw-clash-b" in err


def test_subprocess_sees_a_plugin_on_its_path(fake_site: Path) -> None:
    result = run_pgw(
        "-m", "polygateway", "plugins", "list", "--json", plugins="good", path=fake_site
    )
    assert result.returncode == 0, result.stderr
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    assert rows["pgw-good-example"]["provides"]["transport"] == ["good-transport"]


# --------------------------------------------------------------------------- config check

SECRET = "sk-test-do-not-print-0123456789"
CONFIG_KEY = re.compile(r"^[A-Z][A-Z0-9_]*__|^(LLM|PGW)_|^REDIS_URL$")


@pytest.fixture
def config_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty configuration: no config keys in the environment, no ./.env, no ./pgw.toml."""
    for key in list(os.environ):
        if CONFIG_KEY.search(key):
            monkeypatch.delenv(key)
    monkeypatch.setenv("PGW_PLUGINS", "")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def set_source(monkeypatch: pytest.MonkeyPatch, scope: str = "LLM", **fields: str) -> None:
    values = {"BASE_URL": "http://127.0.0.1:9/v1", "MODEL": "gpt-test", "API_KEY": SECRET}
    for field, value in {**values, **fields}.items():
        monkeypatch.setenv(f"{scope}__OPENAI__1__{field}", value)


def test_config_check_prints_the_resolved_pipeline(
    config_env: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    set_source(monkeypatch)
    assert main(["config", "check"]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[0] == "scope LLM"
    # The governed dispatcher is not a layer any more (formerly "... -> retry -> transport").
    assert lines[1] == "  pipeline: telemetry -> cache -> structured -> transport"
    assert "      api_key: ***" in lines
    assert "      model: gpt-test" in lines
    assert lines[-1] == "configuration OK: 1 scope(s): LLM"
    assert SECRET not in captured.out + captured.err


def test_config_without_action_checks(
    config_env: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    set_source(monkeypatch)
    assert main(["config"]) == 0
    assert capsys.readouterr().out.startswith("scope LLM\n")


def test_config_check_json(
    config_env: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    set_source(monkeypatch)
    assert main(["config", "check", "--json"]) == 0
    out = capsys.readouterr().out
    assert SECRET not in out
    described = json.loads(out)
    [source] = described["scopes"]["LLM"]["sources"]
    assert (source["name"], source["model"], source["api_key"]) == ("openai-1", "gpt-test", "***")
    assert described["scopes"]["LLM"]["middleware"] == ["telemetry", "cache", "structured"]


def test_config_check_problems_one_line_each_exit_2(
    config_env: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    set_source(monkeypatch, TIMEOUT_S="soon")
    monkeypatch.delenv("LLM__OPENAI__1__MODEL")
    monkeypatch.setenv("LLM__SELECTOR", "fastest")
    assert main(["config", "check"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert all(line.startswith("pgw: ") for line in lines)
    assert any(line.startswith("pgw: LLM__OPENAI__1__TIMEOUT_S:") for line in lines)
    assert any(line.startswith("pgw: LLM__OPENAI__1__MODEL:") for line in lines)
    [selector] = [line for line in lines if "'fastest'" in line]
    assert "LLM__SELECTOR" in selector
    assert "least_inflight" in selector
    assert "round_robin" in selector
    assert SECRET not in captured.err


def test_config_check_reads_the_given_files(
    config_env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    env_file = config_env / "custom.env"
    env_file.write_text(
        f"LLM__OPENAI__1__BASE_URL=http://127.0.0.1:9/v1\nLLM__OPENAI__1__MODEL=m\n"
        f"LLM__OPENAI__1__API_KEY={SECRET}\n",
        encoding="utf-8",
    )
    pipeline = config_env / "custom.toml"
    pipeline.write_text('[scopes.LLM]\nmiddleware = ["telemetry", "retry"]\n', encoding="utf-8")
    args = ["config", "check", "--config", str(pipeline), "--env-file", str(env_file)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "  pipeline: telemetry -> retry -> transport\n" in out
    assert SECRET not in out


def test_config_check_missing_file(config_env: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "check", "--config", "missing.toml"]) == 2
    assert "missing.toml" in capsys.readouterr().err


def test_config_check_scope_filter(
    config_env: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    set_source(monkeypatch)
    set_source(monkeypatch, scope="SUMMARY", MODEL="summary-model")
    assert main(["config", "check", "--scope", "summary"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("scope SUMMARY\n")
    assert "scope LLM" not in out
    assert out.splitlines()[-1] == "configuration OK: 2 scope(s): LLM, SUMMARY"

    assert main(["config", "check", "--scope", "LLM", "NOPE"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "pgw: --scope NOPE: unknown scope; configured scopes: LLM, SUMMARY"
    ]


def test_config_check_without_any_scope_fails(
    config_env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["config", "check"]) == 2
    captured = capsys.readouterr()
    assert "pgw: no scope is configured: set {SCOPE}__{PROVIDER}__{N}__BASE_URL" in captured.err
    assert "configuration OK" not in captured.out
