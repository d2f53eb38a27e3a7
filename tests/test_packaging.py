"""A third-party plugin built as a wheel, installed into a venv, is seen by ``pgw plugins list``.

Editable installs can hide entry-point metadata mistakes; wheels cannot. The core is installed
from a freshly built wheel too (``--no-deps``: its dependencies come from the site-packages of
the environment running the tests, which the venv can see; that saves minutes and needs no
network).
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.packaging

REPO = Path(__file__).resolve().parents[1]
CORE = REPO / "polygateway-core"

PLUGIN_PYPROJECT = """
[build-system]
requires = ["hatchling>=1.18"]
build-backend = "hatchling.build"

[project]
name = "pgw-throwaway"
version = "0.0.1"
requires-python = ">=3.11"
dependencies = ["polygateway-core"]

[project.entry-points.polygateway]
throwaway = "pgw_throwaway"

[tool.hatch.build.targets.wheel]
packages = ["src/pgw_throwaway"]
"""

PLUGIN_MODULE = """
from polygateway import hookimpl


class ThrowawayTransport:
    def __init__(self, source, providers=None):
        self.source = source

    async def send(self, request, source, *, call_id):
        raise NotImplementedError

    async def aclose(self):
        pass


@hookimpl
def pgw_register_transports(register):
    register("throwaway-http", ThrowawayTransport)
"""


def run(*command: str | Path, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(
        [str(part) for part in command],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    assert result.returncode == 0, f"{command} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def build_wheel(project: Path, outdir: Path) -> Path:
    run(sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", outdir, project)
    [wheel] = outdir.glob(f"{project.name.replace('-', '_')}-*.whl")
    return wheel


def venv_seeing_this_environment(venv: Path) -> Path:
    """A venv whose own site-packages come first, then this environment's (like
    ``--system-site-packages``, but for whichever environment runs the tests, a venv included).
    Returns the venv's python."""
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    purelib = Path(
        run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").strip()
    )
    ours = dict.fromkeys(
        [sysconfig.get_path("purelib"), sysconfig.get_path("platlib"), *site.getsitepackages()]
    )
    # addsitedir (not a bare path line) so that this environment's own .pth files apply too.
    lines = [f"import site; site.addsitedir({path!r})" for path in ours if Path(path).is_dir()]
    (purelib / "_pgw_test_outer_env.pth").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return python


def test_third_party_plugin_wheel_is_listed(tmp_path: Path) -> None:
    plugin = tmp_path / "pgw-throwaway"
    (plugin / "src" / "pgw_throwaway").mkdir(parents=True)
    (plugin / "pyproject.toml").write_text(textwrap.dedent(PLUGIN_PYPROJECT), encoding="utf-8")
    (plugin / "src" / "pgw_throwaway" / "__init__.py").write_text(
        textwrap.dedent(PLUGIN_MODULE), encoding="utf-8"
    )
    wheels = tmp_path / "wheels"
    core_wheel = build_wheel(CORE, wheels / "core")
    plugin_wheel = build_wheel(plugin, wheels / "plugin")

    venv = tmp_path / "venv"
    python = venv_seeing_this_environment(venv)
    # pip comes from this environment and installs into the venv it runs in.
    run(python, "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed", core_wheel)
    run(python, "-m", "pip", "install", "-q", "--no-deps", plugin_wheel)

    env = {k: v for k, v in os.environ.items() if k not in ("PGW_PLUGINS", "PYTHONPATH")}
    location = run(python, "-c", "import polygateway; print(polygateway.__file__)", env=env)
    assert Path(location.strip()).is_relative_to(venv), "the core must come from the wheel"

    rows = json.loads(run(venv / "bin" / "pgw", "plugins", "list", "--json", env=env))
    by_name = {row["name"]: row for row in rows}
    throwaway = by_name["pgw-throwaway"]
    assert throwaway["status"] == "loaded", throwaway["error"]
    assert throwaway["version"] == "0.0.1"
    assert throwaway["entry_point"] == "throwaway"
    assert throwaway["hooks"] == ["pgw_register_transports"]
    assert throwaway["provides"] == {"transport": ["throwaway-http"]}
    assert by_name["polygateway-core"]["status"] == "loaded"

    only_builtin = dict(env, PGW_PLUGINS="")
    rows = json.loads(run(venv / "bin" / "pgw", "plugins", "list", "--json", env=only_builtin))
    assert [row["name"] for row in rows] == ["polygateway-core"]
