"""What the uploaded bytes are, from their magic number, and how many pages they hold.

MonkeyOCR decides by the upload's filename extension (``.pdf .jpg .jpeg .png``), so the client
names the file after what the bytes really are. The page count only sizes the timeout: a PDF
is counted from its page objects without parsing it (no PDF library), which is exact for
ordinary files and falls back to the page tree's ``/Count`` (or one page) for files whose
objects are compressed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final, Literal

from polygateway.errors import RequestRejectedError

FileKind = Literal["pdf", "png", "jpeg"]

_PNG: Final = b"\x89PNG\r\n\x1a\n"
_JPEG: Final = b"\xff\xd8\xff"
_PDF: Final = b"%PDF-"
_PDF_HEADER_WINDOW: Final = 1024
"""PDF readers accept the header anywhere in the first KiB (junk before it is common)."""

_PAGE_OBJECT = re.compile(rb"/Type\s*/Page(?![A-Za-z])")
_PAGE_COUNT = re.compile(
    rb"/Type\s*/Pages\b[^>]*?/Count\s+(\d+)|/Count\s+(\d+)[^>]*?/Type\s*/Pages\b"
)


@dataclass(frozen=True, slots=True)
class Upload:
    """The bytes to send, with the filename and content type MonkeyOCR expects for them."""

    kind: FileKind
    filename: str
    content_type: str
    pages: int


_NAMES: Final[dict[FileKind, tuple[str, str]]] = {
    "pdf": ("upload.pdf", "application/pdf"),
    "png": ("upload.png", "image/png"),
    "jpeg": ("upload.jpg", "image/jpeg"),
}


def sniff_kind(data: bytes | memoryview) -> FileKind | None:
    """``pdf``, ``png`` or ``jpeg`` from the leading bytes; ``None`` for anything else."""
    head = bytes(data[:_PDF_HEADER_WINDOW])
    if head.startswith(_PNG):
        return "png"
    if head.startswith(_JPEG):
        return "jpeg"
    if _PDF in head:
        return "pdf"
    return None


def count_pdf_pages(data: bytes) -> int:
    """Page objects in the PDF; the page tree's largest ``/Count`` when none are visible
    (compressed object streams); at least 1."""
    objects = len(_PAGE_OBJECT.findall(data))
    if objects:
        return objects
    counts = [int(a or b) for a, b in _PAGE_COUNT.findall(data)]
    return max([1, *counts])


def describe_upload(data: bytes, *, source_name: str | None = None) -> Upload:
    """The ``Upload`` for ``data``; ``RequestRejectedError`` for empty or unsupported bytes."""
    if not isinstance(data, bytes):
        raise RequestRejectedError(
            f"the image must be bytes, got {type(data).__name__}", source_name=source_name
        )
    if not data:
        raise RequestRejectedError("the image is empty (0 bytes)", source_name=source_name)
    kind = sniff_kind(data)
    if kind is None:
        raise RequestRejectedError(
            "MonkeyOCR accepts PDF, PNG and JPEG; these bytes are none of them "
            f"(they start with {bytes(data[:8])!r})",
            source_name=source_name,
        )
    filename, content_type = _NAMES[kind]
    pages = count_pdf_pages(data) if kind == "pdf" else 1
    return Upload(kind=kind, filename=filename, content_type=content_type, pages=pages)


__all__ = ["FileKind", "Upload", "count_pdf_pages", "describe_upload", "sniff_kind"]
