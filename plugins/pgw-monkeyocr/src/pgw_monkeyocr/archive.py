"""The result ZIP of ``/parse``: find the middle.json (one, or one per ``page_{i}/`` in split
mode), read it with bounded decompression, and turn it into a layout.

Nothing is ever extracted to disk; entries are read from memory. Entries with unsafe names
(absolute, ``..``, backslashes, drive letters) are never read and are listed in
``raw["skipped_entries"]``. A member whose decompressed size exceeds the cap, a ZIP with too
many entries, a corrupt ZIP or unparsable JSON are ``ResultInvalidError`` (a bad result is not
a bad service: the breaker counts a success).
"""

from __future__ import annotations

import io
import json
import re
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from pgw_monkeyocr.middle import PageLayout, invalid, middle_pages, parse_page

MAX_ENTRIES: Final = 20_000
_SPLIT_MIDDLE = re.compile(r"^page_(\d+)/[^/]*_middle\.json$")
_SPLIT_MARKDOWN = re.compile(r"^page_(\d+)/[^/]*\.md$")
_DRIVE = re.compile(r"^[A-Za-z]:")


@dataclass(frozen=True, slots=True)
class Layout:
    pages: tuple[PageLayout, ...]
    middle: Any
    """The decoded middle.json (a list of them, by page, in split mode)."""
    markdown: str
    entries: tuple[str, ...]
    skipped_entries: tuple[str, ...]


def safe_name(name: str) -> bool:
    """Whether a ZIP entry name stays inside the archive's root when joined to a directory."""
    if not name or name.startswith("/") or "\\" in name or "\x00" in name or _DRIVE.match(name):
        return False
    return all(part not in ("..",) for part in name.split("/"))


def _read_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, cap: int) -> bytes:
    if info.file_size > cap:
        raise invalid(
            f"ZIP entry {info.filename!r} is {info.file_size} bytes, over the {cap}-byte cap"
        )
    with archive.open(info) as handle:
        data = handle.read(cap + 1)  # the header's size can lie: never trust it alone
    if len(data) > cap:
        raise invalid(f"ZIP entry {info.filename!r} decompresses to more than {cap} bytes")
    return data


def _decode_json(data: bytes, name: str) -> Any:
    try:
        return json.loads(data)
    except ValueError as exc:
        raise invalid(
            f"{name} is not valid JSON ({exc})", raw_text=data[:2000].decode("utf-8", "replace")
        ) from None


def parse_middle_document(document: Any, *, tolerance: float, what: str) -> tuple[PageLayout, ...]:
    """A whole middle.json (standard mode): page ``i`` is the ``i``-th entry of ``pdf_info``."""
    pages = middle_pages(document, what=what)
    return tuple(
        parse_page(page, index, tolerance=tolerance, where=f"{what} page {index}")
        for index, page in enumerate(pages)
    )


def parse_zip(data: bytes, *, tolerance: float, member_cap: int) -> Layout:
    """The layout inside a MonkeyOCR result ZIP (standard or split, told apart by its entries)."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError) as exc:
        raise invalid(f"the result is not a readable ZIP ({exc})") from None
    with archive:
        try:
            return _parse_archive(archive, tolerance=tolerance, member_cap=member_cap)
        except (zipfile.BadZipFile, OSError, EOFError, NotImplementedError, RuntimeError) as exc:
            # CRC mismatches, truncated members, unsupported compression, encrypted entries.
            raise invalid(f"the result ZIP is corrupt ({type(exc).__name__}: {exc})") from None


def _parse_archive(archive: zipfile.ZipFile, *, tolerance: float, member_cap: int) -> Layout:
    infos = archive.infolist()
    if len(infos) > MAX_ENTRIES:
        raise invalid(f"the result ZIP has {len(infos)} entries (at most {MAX_ENTRIES} are read)")
    files = [i for i in infos if not i.is_dir()]
    safe = [i for i in files if safe_name(i.filename)]
    skipped = tuple(i.filename for i in files if not safe_name(i.filename))
    entries = tuple(i.filename for i in safe)
    split = {int(m.group(1)): i for i in safe if (m := _SPLIT_MIDDLE.match(i.filename))}
    if split:
        return _split_layout(archive, split, safe, entries, skipped, tolerance, member_cap)
    middles = sorted(
        (i for i in safe if "/" not in i.filename and i.filename.endswith("_middle.json")),
        key=lambda i: i.filename,
    )
    if not middles:
        raise invalid(f"the result ZIP has no *_middle.json (entries: {', '.join(entries[:20])})")
    info = middles[0]
    document = _decode_json(_read_member(archive, info, member_cap), info.filename)
    pages = parse_middle_document(document, tolerance=tolerance, what=info.filename)
    markdown = [
        _read_member(archive, i, member_cap).decode("utf-8", "replace")
        for i in safe
        if "/" not in i.filename and i.filename.endswith(".md")
    ]
    return Layout(pages, document, "\n\n".join(markdown), entries, skipped)


def _split_layout(
    archive: zipfile.ZipFile,
    split: Mapping[int, zipfile.ZipInfo],
    safe: Sequence[zipfile.ZipInfo],
    entries: tuple[str, ...],
    skipped: tuple[str, ...],
    tolerance: float,
    member_cap: int,
) -> Layout:
    missing = sorted(set(range(max(split) + 1)) - set(split))
    if missing:
        raise invalid(f"the split result ZIP lacks page_{missing[0]}/*_middle.json")
    pages: list[PageLayout] = []
    documents: list[Any] = []
    for index in sorted(split):
        info = split[index]
        document = _decode_json(_read_member(archive, info, member_cap), info.filename)
        documents.append(document)
        page_list = middle_pages(document, what=info.filename)
        if len(page_list) > 1:
            raise invalid(f"{info.filename} holds {len(page_list)} pages, expected one")
        if not page_list:
            raise invalid(f"{info.filename} holds no page")
        # The directory names the page: the file's own page_idx restarts at 0 in split mode.
        pages.append(parse_page(page_list[0], index, tolerance=tolerance, where=info.filename))
    by_page: dict[int, str] = {}
    for info in safe:
        match = _SPLIT_MARKDOWN.match(info.filename)
        if match and int(match.group(1)) not in by_page:
            by_page[int(match.group(1))] = _read_member(archive, info, member_cap).decode(
                "utf-8", "replace"
            )
    markdown = "\n\n".join(by_page[i] for i in sorted(by_page))
    return Layout(tuple(pages), documents, markdown, entries, skipped)


__all__ = ["MAX_ENTRIES", "Layout", "parse_middle_document", "parse_zip", "safe_name"]
