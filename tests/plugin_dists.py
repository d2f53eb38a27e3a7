"""Installs tiny plugin distributions for tests: a ``.dist-info`` folder plus one module on a
directory that the test puts on ``sys.path`` (or ``PYTHONPATH`` for a subprocess).

``importlib.metadata`` finds them exactly like installed distributions, so entry-point
discovery, distribution names and versions go through the real path without a venv.
"""

from __future__ import annotations

import textwrap
import uuid
from dataclasses import dataclass
from pathlib import Path

GOOD_PLUGIN_SOURCE = """
from polygateway import hookimpl


class ExampleTransport:
    def __init__(self, source, providers=None):
        self.source = source


@hookimpl
def pgw_register_transports(register):
    register("{transport}", ExampleTransport)


@hookimpl
def pgw_register_commands(register):
    def configure(parser):
        parser.description = "Say hello from a plugin."
        parser.add_argument("--who", default="world")

        def run(namespace):
            print("hello " + namespace.who)
            return 0

        return run

    register("{command}", configure)
"""

BROKEN_PLUGIN_SOURCE = """
import pgw_test_dependency_that_is_not_installed  # noqa: F401
"""


@dataclass(frozen=True)
class FakeDist:
    dist: str
    entry_point: str
    module: str


def install_fake_plugin(
    site: Path,
    dist: str,
    entry_point: str,
    source: str,
    *,
    version: str = "1.2.3",
    requires: tuple[str, ...] = (),
) -> FakeDist:
    """Write distribution ``dist`` with entry point ``entry_point`` into ``site``.

    The module name is unique per call so that ``sys.modules`` never serves a stale copy.
    """
    module = f"{dist.replace('-', '_')}_{uuid.uuid4().hex[:8]}"
    (site / f"{module}.py").write_text(textwrap.dedent(source), encoding="utf-8")
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    requirements = "".join(f"Requires-Dist: {r}\n" for r in requires)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n{requirements}",
        encoding="utf-8",
    )
    (info / "entry_points.txt").write_text(
        f"[polygateway]\n{entry_point} = {module}\n", encoding="utf-8"
    )
    return FakeDist(dist=dist, entry_point=entry_point, module=module)
