"""Packaging: declared dependencies match the imports of every distribution, and a third-party
plugin built as a wheel, installed into a venv, is seen by ``pgw plugins list``.

Editable installs can hide entry-point metadata mistakes; wheels cannot. The core is installed
from a freshly built wheel too (``--no-deps``: its dependencies come from the site-packages of
the environment running the tests, which the venv can see; that saves minutes and needs no
network).
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import site
import subprocess
import sys
import sysconfig
import textwrap
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.packaging

REPO = Path(__file__).resolve().parents[1]
CORE = REPO / "polygateway-core"

PLUGINS = REPO / "plugins"


def distributions() -> list[Path]:
    """The core and every plugin directory (plugins added later are covered too)."""
    return [CORE, *sorted(p.parent for p in PLUGINS.glob("*/pyproject.toml"))]


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert match, f"unreadable requirement {requirement!r}"
    return normalized(match.group(1))


def own_packages() -> dict[str, str]:
    """Top-level import name -> distribution, for the distributions of this repository (an
    editable install does not record its modules where ``packages_distributions`` looks)."""
    owners: dict[str, str] = {}
    for project in distributions():
        meta = tomllib.loads((project / "pyproject.toml").read_text(encoding="utf-8"))
        packages = meta["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]
        for package in packages:
            owners[Path(package).name] = normalized(meta["project"]["name"])
    return owners


def imported_modules(source_dir: Path) -> Iterator[tuple[str, Path]]:
    """(top-level module, file) of every absolute import, lazy and TYPE_CHECKING ones included."""
    for path in sorted(source_dir.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.partition(".")[0]
                if top not in sys.stdlib_module_names:
                    yield top, path


def dependency_problems(project: Path) -> list[str]:
    meta = tomllib.loads((project / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    name = normalized(meta["name"])
    runtime = {requirement_name(r) for r in meta.get("dependencies", [])}
    extras = {
        requirement_name(r) for reqs in meta.get("optional-dependencies", {}).values() for r in reqs
    }
    owners = own_packages()
    installed = importlib.metadata.packages_distributions()
    problems: list[str] = []
    used: set[str] = set()
    for module, path in imported_modules(project / "src"):
        dists = [owners[module]] if module in owners else installed.get(module, [])
        if not dists:
            problems.append(
                f"{name}: {path.relative_to(project)} imports {module!r}, which no "
                "distribution of this repository or the environment provides"
            )
            continue
        dist_names = {normalized(d) for d in dists}
        if name in dist_names:
            continue
        used |= dist_names
        if not dist_names & (runtime | extras):
            problems.append(
                f"{name}: {path.relative_to(project)} imports {module!r} "
                f"(distribution {', '.join(sorted(dist_names))}) but does not declare it"
            )
    for unused in sorted(runtime - used):
        problems.append(f"{name}: declares the dependency {unused!r} but imports nothing of it")
    return problems


@pytest.mark.parametrize("project", distributions(), ids=lambda p: p.name)
def test_declared_dependencies_are_exactly_the_imported_ones(project: Path) -> None:
    # Runtime dependencies must each be imported; every import must be declared as a runtime
    # dependency or in an extra (optional engines, the pytest-only testing aids).
    assert dependency_problems(project) == []


def test_the_dependency_check_sees_both_kinds_of_mistake(tmp_path: Path) -> None:
    project = tmp_path / "pgw-sloppy"
    (project / "src" / "pgw_sloppy").mkdir(parents=True)
    (project / "pyproject.toml").write_text(
        '[project]\nname = "pgw-sloppy"\ndependencies = ["orjson>=3", "pydantic>=2"]\n'
        '[tool.hatch.build.targets.wheel]\npackages = ["src/pgw_sloppy"]\n',
        encoding="utf-8",
    )
    (project / "src" / "pgw_sloppy" / "__init__.py").write_text(
        "import json\nimport orjson\n\n\ndef f():\n    import httpx\n", encoding="utf-8"
    )
    problems = "\n".join(dependency_problems(project))
    assert "imports 'httpx' (distribution httpx) but does not declare it" in problems
    assert "declares the dependency 'pydantic' but imports nothing of it" in problems
    assert "orjson" not in problems and "json'" not in problems


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
