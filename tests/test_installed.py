"""``polygateway.installed``: what its own reading of the installed distributions answers is what
``importlib.metadata`` answers (the definition), on this environment and on distributions made
for the cases that matter; what it does not read the same way is handed to
``importlib.metadata`` whole."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from polygateway import installed
from polygateway.installed import FoundEntryPoint, scan

GROUP = "polygateway"


def _definition() -> Any:
    return installed._ByImportlib()


def _rows(found: list[FoundEntryPoint]) -> list[tuple[Any, ...]]:
    return [(e.name, e.value, e.dist, e.version, e.requirements) for e in found]


def _dist(
    site: Path,
    folder: str,
    metadata: str,
    entry_points: str | None = None,
    module: tuple[str, str] | None = None,
) -> None:
    info = site / folder
    info.mkdir()
    (info / "METADATA").write_text(textwrap.dedent(metadata).lstrip(), encoding="utf-8")
    if entry_points is not None:
        (info / "entry_points.txt").write_text(textwrap.dedent(entry_points), encoding="utf-8")
    if module is not None:
        (site / f"{module[0]}.py").write_text(module[1], encoding="utf-8")


@pytest.fixture
def sites(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """Two directories at the front of ``sys.path``, the first searched first."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    monkeypatch.syspath_prepend(str(second))
    monkeypatch.syspath_prepend(str(first))
    importlib.invalidate_caches()  # importlib.metadata's listings are cached per directory
    return first, second


def _same_answers(names: list[str]) -> None:
    found = scan()
    definition = _definition()
    assert _rows(found.entry_points(GROUP)) == _rows(definition.entry_points(GROUP))
    for name in names:
        assert found.has(name) == definition.has(name), name
        try:
            expected: Any = definition.version(name)
        except LookupError:
            with pytest.raises(LookupError):
                found.version(name)
        else:
            assert found.version(name) == expected, name


def test_this_environment_reads_the_same_without_importlib_metadata() -> None:
    found = scan()
    assert isinstance(found, installed._Paths)  # a plain environment: read here
    assert found.entry_points(GROUP), "the plugins of this checkout are installed"
    _same_answers(["polygateway-core", "pluggy", "Pluggy", "typing_extensions", "no-such-dist"])


def test_made_distributions_read_the_same(sites: tuple[Path, Path]) -> None:
    first, second = sites
    _dist(
        first,
        "Pgw.Fancy_Thing-2.0.dist-info",
        """
        Metadata-Version: 2.1
        Name: Pgw.Fancy_Thing
        Version: 2.0
        Requires-Dist: pluggy>=1
        Requires-Dist: nothing-installed-here ; extra == "x"
        requires-dist: folded-requirement>=1
          ; python_version >= "3"

        Requires-Dist: in-the-body-not-a-header
        """,
        """
        # a comment line
        [console_scripts]
        fancy = pgw_fancy:main

        [polygateway]
          fancy = pgw_fancy:plugin.inner [extra]
        second=pgw_fancy
        """,
    )
    _dist(  # shadowed by a distribution of the same name earlier on the path
        second,
        "pgw_fancy_thing-1.0.dist-info",
        "Name: pgw-fancy-thing\nVersion: 1.0\n",
        "[polygateway]\nold = pgw_fancy_old\n",
    )
    _dist(second, "pgw_other-0.1.dist-info", "Name: pgw-other\nVersion: 0.1\n", "[polygateway]\n")
    _same_answers(["pgw-fancy-thing", "PGW_FANCY.THING", "pgw-other", "nothing-installed-here"])
    rows = _rows(scan().entry_points(GROUP))
    assert ("fancy", "pgw_fancy:plugin.inner [extra]", "Pgw.Fancy_Thing", "2.0") in [
        row[:4] for row in rows
    ]
    assert scan().version("pgw-fancy-thing") == "2.0"  # the first on the path wins


def test_entry_points_load_as_importlib_metadata_loads_them(sites: tuple[Path, Path]) -> None:
    first, _ = sites
    _dist(
        first,
        "pgw_loads-1.0.dist-info",
        "Name: pgw-loads\nVersion: 1.0\n",
        "[polygateway]\nattr = pgw_loads_mod:outer.inner\nmodule = pgw_loads_mod\n"
        "bad = not a valid value!\nmissing = pgw_loads_absent_module\n",
        ("pgw_loads_mod", "class outer:\n    inner = 42\n"),
    )
    found = {e.name: e for e in scan().entry_points(GROUP)}
    definition = {e.name: e for e in _definition().entry_points(GROUP)}
    assert found["attr"].load() == definition["attr"].load() == 42
    assert found["module"].load() is definition["module"].load() is sys.modules["pgw_loads_mod"]
    for name in ("bad", "missing"):
        with pytest.raises(Exception) as here:
            found[name].load()
        with pytest.raises(Exception) as there:
            definition[name].load()
        assert (type(here.value), str(here.value)) == (type(there.value), str(there.value))


@pytest.mark.parametrize(
    ("folder", "metadata", "entry_points"),
    [
        ("pgw_egg-1.0.egg-info", "Name: pgw-egg\nVersion: 1.0\n", "[polygateway]\negg = m\n"),
        ("pgw_upper-1.0.DIST-INFO", "Name: pgw-upper\nVersion: 1.0\n", "[polygateway]\nu = m\n"),
    ],
    ids=["egg-info", "upper-case-suffix"],
)
def test_what_it_does_not_read_itself_is_read_by_importlib_metadata(
    sites: tuple[Path, Path], folder: str, metadata: str, entry_points: str
) -> None:
    first, _ = sites
    _dist(first, folder, metadata, entry_points)
    found = scan()
    assert isinstance(found, installed._ByImportlib)
    assert _rows(found.entry_points(GROUP)) == _rows(_definition().entry_points(GROUP))


@pytest.mark.parametrize(
    ("metadata", "entry_points"),
    [
        ("Name: pgw-odd\r\nVersion: 1.0\r\n", "[polygateway]\nodd = m\n"),  # CR LF lines
        ("Version: 1.0\n", "[polygateway]\nodd = m\n"),  # no Name
        ("Name: pgw-odd\nVersion: 1.0\nnot a header\n", "[polygateway]\nodd = m\n"),
    ],
    ids=["crlf", "no-name", "not-a-header"],
)
def test_a_metadata_it_does_not_read_the_same_way_is_read_by_importlib_metadata(
    sites: tuple[Path, Path], metadata: str, entry_points: str
) -> None:
    first, _ = sites
    info = first / "pgw_odd-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_bytes(metadata.encode())
    (info / "entry_points.txt").write_text(entry_points, encoding="utf-8")
    assert _rows(scan().entry_points(GROUP)) == _rows(_definition().entry_points(GROUP))


def test_an_entry_point_line_without_equals_fails_as_importlib_metadata_fails(
    sites: tuple[Path, Path],
) -> None:
    first, _ = sites
    _dist(first, "pgw_eq-1.0.dist-info", "Name: pgw-eq\nVersion: 1.0\n", "[other]\nnoequals\n")
    with pytest.raises(TypeError) as here:
        scan().entry_points(GROUP)
    with pytest.raises(TypeError) as there:
        importlib.metadata.entry_points(group=GROUP)
    assert str(here.value) == str(there.value)


def test_a_ready_client_imports_no_importlib_metadata_in_a_plain_environment(
    tmp_path: Path,
) -> None:
    # importlib.metadata and what it imports (email, zipfile, csv) were ~90 M instructions of
    # a default client's start-up; read here, the same answers cost a tenth of that.
    code = (
        "import sys\n"
        "from polygateway import GatewayClient\n"
        "GatewayClient.from_env(env={'LLM__OPENAI__1__BASE_URL': 'http://127.0.0.1:9/v1',"
        " 'LLM__OPENAI__1__API_KEY': 'sk-test', 'LLM__OPENAI__1__MODEL': 'm'})\n"
        "from polygateway.installed import _Paths, scan\n"
        "print(isinstance(scan(), _Paths))\n"
        "print([m for m in ('importlib.metadata', 'email', 'zipfile', 'csv')"
        " if m in sys.modules])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path
    )
    plain, imported = done.stdout.split("\n")[:2]
    if plain != "True":
        pytest.skip("this environment is not the plain case (an egg or zip on sys.path)")
    assert imported == "[]"
