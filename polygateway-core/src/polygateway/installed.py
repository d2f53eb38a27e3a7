"""Installed distributions as plugin discovery needs them, read as ``importlib.metadata`` reads
them: the entry points of one group with their distribution's name, version and declared
requirements, whether a distribution is installed, and its version.

``importlib.metadata`` cost a default client about 90 M instructions of its start-up (its
import pulls ``email``, ``zipfile`` and ``csv``; its scan makes an ``EntryPoint`` of every
entry point of every distribution, and each ``METADATA`` goes through the ``email`` parser).
In the usual case (the directories on ``sys.path`` hold ``*.dist-info`` folders, and no
finder but the standard one finds distributions) ``scan`` reads the same files itself, as
``importlib.metadata`` does: the paths in order, each one's folders in the order the
directory lists them, the first distribution of a normalised name winning, ``entry_points.txt``
parsed the same way, ``Name``, ``Version`` and ``Requires-Dist`` read from the ``METADATA``
headers as the ``email`` parser reads them. Anything else (a zip archive or an egg on
``sys.path``, an ``.egg-info``, a ``METADATA`` it cannot read the same way, another finder) is
left to ``importlib.metadata`` whole (``tests/test_installed.py`` holds the two to the same
answers).
"""

from __future__ import annotations

import functools
import importlib
import importlib.machinery
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

from polygateway.frozen import frozen_dataclass

_ENTRY_POINT_VALUE = re.compile(
    r"(?P<module>[\w.]+)\s*(:\s*(?P<attr>[\w.]+)\s*)?((?P<extras>\[.*\])\s*)?$"
)
"""``importlib.metadata.EntryPoint.pattern``: ``module[:attr][ [extras]]``."""

_NOT_FOUND = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)
"""What ``PathDistribution.read_text`` takes for an absent file."""

_HEADER_NAME = re.compile(r"[\x21-\x39\x3b-\x7e]+")
"""A header name as the ``email`` parser recognises one (printable, no colon)."""


def normalize(name: str) -> str:
    """``importlib.metadata.Prepared.normalize``: PEP 503, with underscores."""
    return re.sub(r"[-_.]+", "-", name).lower().replace("-", "_")


@frozen_dataclass(slots=True)
class FoundEntryPoint:
    """One entry point of the group asked for, with its distribution's metadata."""

    name: str
    value: str
    load: Callable[[], Any]
    """Imports the module and returns the object named (``EntryPoint.load``)."""
    dist: str | None
    """The distribution's ``Name``; ``None`` for an entry point of no distribution."""
    version: str | None
    requirements: tuple[str, ...]
    """Its ``Requires-Dist`` lines (an egg-info distribution's ``requires.txt``)."""


class Installed:
    """What ``scan`` found: answers from the files it read, or from ``importlib.metadata``."""

    def entry_points(self, group: str) -> list[FoundEntryPoint]:
        raise NotImplementedError

    def has(self, name: str) -> bool:
        """Whether distribution ``name`` is installed (``importlib.metadata.distribution``)."""
        raise NotImplementedError

    def version(self, name: str) -> str | None:
        """``importlib.metadata.version(name)``; ``LookupError`` when it is not installed."""
        raise NotImplementedError


def scan() -> Installed:
    """The installed distributions on ``sys.path``, read now."""
    finders = [f for f in sys.meta_path if getattr(f, "find_distributions", None) is not None]
    if len(finders) == 1 and finders[0] is importlib.machinery.PathFinder:
        found = _scan_paths(sys.path)
        if found is not None:
            return found
    return _ByImportlib()


class _Dist:
    __slots__ = ("_headers", "path")

    def __init__(self, path: str) -> None:
        self.path = path
        self._headers: dict[str, list[str]] | None = None

    def read_text(self, filename: str) -> str | None:
        try:
            with open(os.path.join(self.path, filename), encoding="utf-8") as file:
                return file.read()
        except _NOT_FOUND:
            return None

    def headers(self) -> dict[str, list[str]]:
        if self._headers is None:
            self._headers = _headers(self.read_text("METADATA") or self.read_text("PKG-INFO"))
        return self._headers

    def first(self, name: str) -> str | None:
        values = self.headers().get(name.lower())
        return values[0] if values else None


class _Unreadable(Exception):
    """A ``METADATA`` this module does not read as the ``email`` parser would."""


def _headers(text: str | None) -> dict[str, list[str]]:
    """The header fields of ``METADATA`` (lower-cased names), as ``email``'s ``compat32``
    parser gives them: the lines before the first empty one, each value after its colon with
    leading blanks dropped. Anything less plain (a folded line, which
    ``importlib.metadata`` re-indents, a line that is no header, a carriage return) raises
    ``_Unreadable``."""
    if not text:
        raise _Unreadable("no METADATA")
    fields: dict[str, list[str]] = {}
    for line in text.split("\n"):
        if not line:
            break
        name, colon, value = line.partition(":")
        if not colon or "\r" in line or _HEADER_NAME.fullmatch(name) is None:
            raise _Unreadable("not a plain header line")
        fields.setdefault(name.lower(), []).append(value.lstrip(" \t"))
    return fields


class _Paths(Installed):
    def __init__(self, by_name: dict[str, list[_Dist]]) -> None:
        self._by_name = by_name  # normalised name -> its distributions, in sys.path order

    def entry_points(self, group: str) -> list[FoundEntryPoint]:
        try:
            return self._entry_points(group)
        except _Unreadable:
            return _ByImportlib().entry_points(group)

    def _entry_points(self, group: str) -> list[FoundEntryPoint]:
        found: list[FoundEntryPoint] = []
        # Every distribution's file is parsed, as importlib.metadata parses them all.
        chosen = [
            (dists[0], pairs)  # the first of a name wins
            for dists in self._by_name.values()
            if (pairs := _pairs(dists[0].read_text("entry_points.txt"), group))
        ]
        for dist, pairs in chosen:
            name, version = dist.first("Name"), dist.first("Version")
            if name is None or version is None:
                raise _Unreadable("no Name or Version")
            requirements = tuple(dist.headers().get("requires-dist", ()))
            if not requirements and dist.read_text("requires.txt") is not None:
                raise _Unreadable("requirements in an egg's requires.txt")
            found.extend(
                FoundEntryPoint(
                    entry, value, functools.partial(_load, value), name, version, requirements
                )
                for entry, value in pairs
            )
        return found

    def has(self, name: str) -> bool:
        return normalize(name) in self._by_name

    def version(self, name: str) -> str | None:
        dists = self._by_name.get(normalize(name))
        if not dists:
            raise LookupError(name)
        try:
            return dists[0].first("Version")
        except _Unreadable:
            return _ByImportlib().version(name)


def _scan_paths(paths: Sequence[str]) -> _Paths | None:
    """``None`` when something here is not the usual case (see the module's docstring)."""
    by_name: dict[str, list[_Dist]] = {}  # in first-seen order, as ``_unique`` keeps them
    for root in paths:
        try:
            children = os.listdir(root or ".")
        except Exception:  # noqa: BLE001 - as importlib.metadata's FastPath.children
            if os.path.isfile(root):
                return None  # a zip archive, perhaps: importlib.metadata reads those
            continue
        if os.path.basename(root).lower().endswith(".egg"):
            return None
        listed: dict[str, list[_Dist]] = {}
        for child in children:
            low = child.lower()
            if low.endswith(".egg-info"):
                return None
            if low.endswith(".dist-info"):
                if not child.endswith(".dist-info"):
                    return None  # its name would come from its METADATA, not its folder's
                name = normalize(low.rpartition(".")[0].partition("-")[0])
                listed.setdefault(name, []).append(_Dist(os.path.join(root, child)))
        for name, dists in listed.items():
            by_name.setdefault(name, []).extend(dists)
    return _Paths(by_name)


def _pairs(text: str | None, group: str) -> list[tuple[str, str]]:
    """The (name, value) entries of section ``group`` of an ``entry_points.txt``, read as
    ``importlib.metadata``'s ``Sectioned`` reads it: stripped lines, comments and lines before
    any section left out; a line without ``=`` raises (there a ``TypeError``)."""
    pairs: list[tuple[str, str]] = []
    section: str | None = None
    for raw in (text or "").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line.strip("[]")
            continue
        if section is not None:
            name, equals, value = line.partition("=")
            if not equals:
                raise _Unreadable("an entry point line without '='")
            if section == group:
                pairs.append((name.strip(), value.strip()))
    return pairs


def _load(value: str) -> Any:
    """``importlib.metadata.EntryPoint.load`` of an entry point's ``value``."""
    match = _ENTRY_POINT_VALUE.match(value)
    if match is None:
        # What ``EntryPoint.load`` raises for it (it reads the groups of a failed match).
        raise AttributeError("'NoneType' object has no attribute 'group'")
    module = importlib.import_module(match.group("module"))
    attrs = filter(None, (match.group("attr") or "").split("."))
    return functools.reduce(getattr, attrs, module)


class _ByImportlib(Installed):
    def __init__(self) -> None:
        import importlib.metadata

        self._metadata = importlib.metadata

    def entry_points(self, group: str) -> list[FoundEntryPoint]:
        found: list[FoundEntryPoint] = []
        for ep in self._metadata.entry_points(group=group):
            if ep.dist is None:
                found.append(FoundEntryPoint(ep.name, ep.value, ep.load, None, None, ()))
                continue
            metadata = ep.dist.metadata
            requirements = metadata.get_all("Requires-Dist") or ep.dist.requires or ()
            found.append(
                FoundEntryPoint(
                    ep.name,
                    ep.value,
                    ep.load,
                    metadata["Name"],
                    metadata["Version"],
                    # An egg-info distribution keeps them in requires.txt.
                    tuple(requirements),
                )
            )
        return found

    def has(self, name: str) -> bool:
        try:
            self._metadata.distribution(name)
        except self._metadata.PackageNotFoundError:
            return False
        return True

    def version(self, name: str) -> str | None:
        try:
            return self._metadata.version(name)
        except self._metadata.PackageNotFoundError:
            raise LookupError(name) from None
