"""``*_middle.json`` -> layout elements in page coordinates, with the bboxes validated.

The file is MinerU's intermediate format as MonkeyOCR writes it: ``{"pdf_info": [page, ...]}``,
each page with ``page_size: [w, h]`` and ``para_blocks`` (``preproc_blocks`` when a version
writes no paragraphs). One element per block, in reading order:

- ``text``, ``title``, ``list``, ``index`` (and unknown types with lines): ``text`` is the
  block's spans, a line per line, inline equations as ``$...$``;
- ``interline_equation``: ``latex`` holds the formula;
- group blocks ``table`` / ``image``: one element with the group's bbox and the body's content
  (``html`` or ``latex`` for tables), then one element per caption / footnote sub-block
  (``table_caption``, ``image_footnote``...) with its own bbox and text.

A bbox must be four finite numbers with ``x0 < x1`` and ``y0 < y1`` inside the page; one that
sticks out by at most ``tolerance`` x the page size is clamped onto the page, anything else is
reported as an ``OcrBBoxIssue`` and the element left out. A page without a usable
``page_size`` makes the whole result unusable (``ResultInvalidError``): its coordinates mean
nothing.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from polygateway.errors import ResultInvalidError
from polygateway.types import OcrBBoxIssue, OcrElement

GROUP_TYPES: Final = frozenset({"table", "image"})
_BODY_TYPES: Final = frozenset({"table_body", "image_body"})
_EQUATION_TYPES: Final = frozenset({"interline_equation"})


@dataclass(frozen=True, slots=True)
class PageLayout:
    """One page's elements, size and rejected bboxes."""

    page_idx: int
    size: tuple[float, float]
    elements: tuple[OcrElement, ...]
    issues: tuple[OcrBBoxIssue, ...]


def invalid(message: str, raw_text: str = "") -> ResultInvalidError:
    return ResultInvalidError(f"MonkeyOCR layout result unusable: {message}", raw_text=raw_text)


def middle_pages(document: Any, *, what: str) -> list[Mapping[str, Any]]:
    """The ``pdf_info`` pages of a decoded middle.json (``what`` names the file in errors)."""
    if not isinstance(document, Mapping):
        raise invalid(f"{what} is not a JSON object")
    pages = document.get("pdf_info")
    if not isinstance(pages, list) or not all(isinstance(p, Mapping) for p in pages):
        raise invalid(f"{what} has no 'pdf_info' list of pages")
    return pages


def _page_size(page: Mapping[str, Any], where: str) -> tuple[float, float]:
    size = page.get("page_size")
    if (
        isinstance(size, Sequence)
        and not isinstance(size, str)
        and len(size) == 2
        and all(_is_number(v) for v in size)
    ):
        width, height = float(size[0]), float(size[1])
        if math.isfinite(width) and math.isfinite(height) and width > 0 and height > 0:
            return width, height
    raise invalid(f"{where} has no usable page_size (got {_json(size)})")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _json(value: Any) -> str:
    try:
        return json.dumps(value, allow_nan=True)[:200]
    except (TypeError, ValueError):
        return repr(value)[:200]


def _blocks(page: Mapping[str, Any]) -> list[Any]:
    blocks = page.get("para_blocks")
    if blocks is None:
        blocks = page.get("preproc_blocks")
    return blocks if isinstance(blocks, list) else []


def _spans(block: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    for line in block.get("lines") or ():
        if isinstance(line, Mapping):
            for span in line.get("spans") or ():
                if isinstance(span, Mapping):
                    yield span


def block_text(block: Mapping[str, Any]) -> str:
    """The block's text: spans joined by spaces, lines by newlines, ``$..$`` inline maths."""
    lines: list[str] = []
    for line in block.get("lines") or ():
        if not isinstance(line, Mapping):
            continue
        parts: list[str] = []
        for span in line.get("spans") or ():
            if not isinstance(span, Mapping):
                continue
            content = span.get("content")
            if not isinstance(content, str) or not content.strip():
                continue
            kind = span.get("type")
            if kind == "inline_equation":
                parts.append(f"${content.strip()}$")
            elif kind in ("text", "interline_equation", None):
                parts.append(content.strip())
        if parts:
            lines.append(" ".join(parts))
    return "\n".join(lines)


def _span_field(blocks: Sequence[Mapping[str, Any]], key: str) -> str | None:
    for block in blocks:
        for span in _spans(block):
            value = span.get(key)
            if isinstance(value, str) and value:
                return value
    return None


class _PageParser:
    __slots__ = ("elements", "issues", "page_idx", "size", "tolerance")

    def __init__(self, page_idx: int, size: tuple[float, float], tolerance: float) -> None:
        self.page_idx = page_idx
        self.size = size
        self.tolerance = tolerance
        self.elements: list[OcrElement] = []
        self.issues: list[OcrBBoxIssue] = []

    def add(
        self,
        kind: str,
        bbox: Any,
        *,
        text: str = "",
        html: str | None = None,
        latex: str | None = None,
    ) -> None:
        checked, reason = check_bbox(bbox, self.size, self.tolerance)
        if checked is None:
            self.issues.append(
                OcrBBoxIssue(
                    page_idx=self.page_idx, type=kind, bbox=_json(bbox), reason=reason, text=text
                )
            )
            return
        self.elements.append(
            OcrElement(
                type=kind, bbox=checked, page_idx=self.page_idx, text=text, html=html, latex=latex
            )
        )

    def block(self, block: Any) -> None:
        if not isinstance(block, Mapping):
            return
        kind = str(block.get("type") or "unknown")
        if kind in GROUP_TYPES:
            self.group(kind, block)
        elif kind in _EQUATION_TYPES:
            self.add(kind, block.get("bbox"), latex=_span_field([block], "content") or "")
        else:
            self.add(kind, block.get("bbox"), text=block_text(block))

    def group(self, kind: str, block: Mapping[str, Any]) -> None:
        subs = [b for b in block.get("blocks") or () if isinstance(b, Mapping)]
        bodies = [b for b in subs if b.get("type") in _BODY_TYPES]
        self.add(
            kind,
            block.get("bbox"),
            html=_span_field(bodies, "html"),
            latex=_span_field(bodies, "latex"),
        )
        for sub in subs:
            if sub.get("type") not in _BODY_TYPES:
                self.add(
                    str(sub.get("type") or f"{kind}_part"), sub.get("bbox"), text=block_text(sub)
                )


def check_bbox(
    bbox: Any, size: tuple[float, float], tolerance: float
) -> tuple[tuple[float, float, float, float] | None, str]:
    """``(bbox, "")`` valid (clamped onto the page), or ``(None, reason)``."""
    if (
        not isinstance(bbox, Sequence)
        or isinstance(bbox, str)
        or len(bbox) != 4
        or not all(_is_number(v) for v in bbox)
    ):
        return None, "not four numbers"
    x0, y0, x1, y1 = (float(v) for v in bbox)
    if not all(math.isfinite(v) for v in (x0, y0, x1, y1)):
        return None, "not finite"
    if not x0 < x1:
        return None, "x0 >= x1"
    if not y0 < y1:
        return None, "y0 >= y1"
    width, height = size
    slack_x, slack_y = tolerance * width, tolerance * height
    if x0 < -slack_x or y0 < -slack_y or x1 > width + slack_x or y1 > height + slack_y:
        return None, f"outside the {width:g}x{height:g} page"
    clamped = (max(x0, 0.0), max(y0, 0.0), min(x1, width), min(y1, height))
    if not (clamped[0] < clamped[2] and clamped[1] < clamped[3]):
        return None, f"outside the {width:g}x{height:g} page"
    return clamped, ""


def parse_page(
    page: Mapping[str, Any], page_idx: int, *, tolerance: float, where: str
) -> PageLayout:
    """One ``pdf_info`` page as a ``PageLayout`` (``page_idx`` is the caller's: the position in
    the document, or the ``page_{i}`` directory of a split ZIP)."""
    size = _page_size(page, where)
    parser = _PageParser(page_idx, size, tolerance)
    for block in _blocks(page):
        parser.block(block)
    return PageLayout(page_idx, size, tuple(parser.elements), tuple(parser.issues))


__all__ = ["PageLayout", "block_text", "check_bbox", "invalid", "middle_pages", "parse_page"]
