"""A fake MonkeyOCR server: real HTTP on loopback, the FastAPI server's answers byte for byte.

It serves several logical sources on one port (``base_url("a")`` -> ``http://127.0.0.1:P/a``),
each with the routes of MonkeyOCR's ``api/main.py``: ``GET /``, ``GET /health``,
``POST /ocr/{text,formula,table}``, ``POST /parse``, ``POST /parse/split`` (query
``return_type``) and ``GET /static/{name}``. The ZIPs are real: ``{name}.md``,
``{name}_content_list.json``, ``{name}_middle.json``, the three PDFs and ``images/``; split
mode uses ``page_{i}/{original}_{safe}_page_{i}_*`` names. Both server variants exist: the one
with ``return_type`` and ``content``/``content_type`` in ``ParseResponse`` and the older one
without them (which redirects ``GET /`` to its dashboard).

By default a request is answered as the real server would answer it: the page sizes come from
the upload (a PDF's ``/MediaBox`` per page, a PNG's or JPEG's pixel size) and each page gets a
title, a paragraph with inline maths, an equation, a table with a caption and a figure with a
caption. ``script(source, *replies)`` queues what the next POSTs of a source answer instead:
failures of every kind MonkeyOCR has (``success:false``, ``Parsing failed``, 422, any status,
connection resets, slow answers), ZIP faults (no middle.json, corrupt, unparsable JSON, unsafe
entry names, a decompression bomb, padding past a size cap) and download faults (stalled
mid-body, an announced length past any cap, the ZIP gone). ``configure(source, ...)`` sets
``model_loaded``, the variant and the global lock of synchronous backends.

    with FakeMonkeyOcr.in_thread() as fake:          # own loop in a daemon thread
        fake.script("a", Reply.ocr_failed("CUDA out of memory"))
        url = fake.base_url("a")

    async with FakeMonkeyOcr() as fake:              # on the running loop
        ...

The pytest fixture ``fake_monkeyocr`` (``pgw_monkeyocr.pytest_plugin``, loaded through the
``pytest11`` entry point) is one in-thread server per session, reset for every test.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import json
import re
import socket
import struct
import threading
import time
import uuid
import zipfile
import zlib
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from aiohttp import BodyPartReader, web
from aiohttp.web_protocol import RequestHandler
from polygateway.testing.threads import serve_in_thread

__all__ = [
    "ALLOWED_EXTENSIONS",
    "DEFAULT_TEXT",
    "FakeMonkeyOcr",
    "FakePage",
    "ReceivedUpload",
    "Reply",
    "default_blocks",
    "equation_block",
    "image_block",
    "make_jpeg",
    "make_pdf",
    "make_png",
    "table_block",
    "text_block",
]

DEFAULT_TEXT: Final = "Hello from the fake MonkeyOCR."
DEFAULT_SOURCE: Final = "default"
ALLOWED_EXTENSIONS: Final = (".pdf", ".jpg", ".jpeg", ".png")
RETURN_TYPES: Final = (
    "zip_all",
    "zip_markdown",
    "content_list_json",
    "middle_json",
    "model_pdf",
    "layout_pdf",
    "spans_pdf",
)
_KEEP_BODY_BYTES: Final = 8 * 1024 * 1024
"""How much of a PDF upload is kept (its page sizes are read from it)."""
_HEAD_BYTES: Final = 64 * 1024
"""How much of an image upload is kept (its pixel size is in the header)."""
_FAKE_JPEG: Final = b"\xff\xd8\xff\xe0\x00\x10JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00\xff\xd9"
_FAKE_PDF: Final = b"%PDF-1.4\n% fake drawing\n%%EOF\n"

ReplyKind = Literal["ok", "ocr_failed", "parse_failed", "status", "reset", "content"]
ZipFault = Literal["no_middle", "corrupt", "bad_json", "traversal"]
DownloadMode = Literal["ok", "stall", "announce_huge", "gone"]
Variant = Literal["return_type", "dashboard"]


# --------------------------------------------------------------------------- test inputs


def make_pdf(page_sizes: Sequence[tuple[float, float]] = ((595.0, 842.0),)) -> bytes:
    """A small valid PDF with one empty page per size (points, as ``/MediaBox``)."""
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>"]
    kids = " ".join(f"{3 + i} 0 R" for i in range(len(page_sizes)))
    objects.append(f"<< /Type /Pages /Kids [{kids}] /Count {len(page_sizes)} >>".encode())
    for width, height in page_sizes:
        objects.append(
            f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 {width:g} {height:g}] >>".encode()
        )
    out = io.BytesIO()
    out.write(b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n")
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(out.tell())
        out.write(b"%d 0 obj\n%s\nendobj\n" % (number, body))
    xref = out.tell()
    out.write(b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1))
    for offset in offsets:
        out.write(b"%010d 00000 n \n" % offset)
    out.write(
        b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    )
    return out.getvalue()


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def make_png(width: int = 640, height: int = 480, *, size: int | None = None) -> bytes:
    """A valid grey PNG of ``width`` x ``height``; ``size`` pads it (private ancillary chunk)
    to about that many bytes, for large-upload tests."""
    raw = b"".join(b"\x00" + b"\x80" * width for _ in range(height))
    head = b"\x89PNG\r\n\x1a\n" + _png_chunk(
        b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    )
    body = _png_chunk(b"IDAT", zlib.compress(raw, 9))
    tail = _png_chunk(b"IEND", b"")
    if size is not None:
        missing = size - len(head) - len(body) - len(tail) - 12
        if missing > 0:
            body += _png_chunk(b"pgWp", bytes(missing))
    return head + body + tail


def make_jpeg(width: int = 640, height: int = 480) -> bytes:
    """JPEG markers with a baseline SOF0 of ``width`` x ``height`` (enough for the sniffers)."""
    sof = b"\xff\xc0" + struct.pack(">HBHHB", 11, 8, height, width, 1) + b"\x01\x11\x00"
    return (
        b"\xff\xd8\xff\xe0\x00\x10JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00" + sof + b"\xff\xd9"
    )


_MEDIABOX = re.compile(rb"/MediaBox\s*\[\s*([-\d.]+)\s+([-\d.]+)\s+([-\d.]+)\s+([-\d.]+)\s*\]")


def _page_sizes_of(kind: str, data: bytes) -> list[tuple[float, float]]:
    if kind == ".pdf":
        sizes = [
            (float(x1) - float(x0), float(y1) - float(y0))
            for x0, y0, x1, y1 in _MEDIABOX.findall(data)
        ]
        return sizes or [(595.0, 842.0)]
    if data.startswith(b"\x89PNG") and len(data) >= 24:
        width, height = struct.unpack(">II", data[16:24])
        return [(float(width), float(height))]
    if data.startswith(b"\xff\xd8"):
        at = 2
        while at + 9 < len(data) and data[at] == 0xFF:
            marker, length = data[at + 1], struct.unpack(">H", data[at + 2 : at + 4])[0]
            if marker in (0xC0, 0xC1, 0xC2):
                height, width = struct.unpack(">HH", data[at + 5 : at + 9])
                return [(float(width), float(height))]
            at += 2 + length
    return [(1000.0, 1000.0)]


# --------------------------------------------------------------------------- layout blocks


def _span_line(
    bbox: Sequence[float], spans: list[dict[str, Any]], index: int = 0
) -> dict[str, Any]:
    return {"bbox": list(bbox), "spans": spans, "index": index}


def text_block(
    bbox: Sequence[Any], text: str, *, type: str = "text", index: int = 0
) -> dict[str, Any]:
    """A ``text`` (or ``title``/``list``/...) block, one line per ``\\n`` of ``text``."""
    lines = [
        _span_line(bbox, [{"bbox": list(bbox), "score": 1.0, "type": "text", "content": line}], i)
        for i, line in enumerate(text.split("\n"))
    ]
    return {"type": type, "bbox": list(bbox), "lines": lines, "index": index}


def equation_block(bbox: Sequence[Any], latex: str, *, index: int = 0) -> dict[str, Any]:
    span = {"bbox": list(bbox), "score": 1.0, "type": "interline_equation", "content": latex}
    return {
        "type": "interline_equation",
        "bbox": list(bbox),
        "lines": [_span_line(bbox, [span])],
        "index": index,
    }


def table_block(
    bbox: Sequence[Any],
    *,
    html: str | None = None,
    latex: str | None = None,
    caption: str | None = None,
    caption_bbox: Sequence[Any] | None = None,
    body_bbox: Sequence[Any] | None = None,
    image_path: str = "ab12.jpg",
    index: int = 0,
) -> dict[str, Any]:
    """A ``table`` group: a ``table_body`` (``html`` or ``latex``) and an optional caption."""
    body = list(body_bbox or bbox)
    span: dict[str, Any] = {"bbox": body, "score": 1.0, "type": "table", "image_path": image_path}
    if latex is not None:
        span["latex"] = latex
    if html is not None:
        span["html"] = html
    blocks: list[dict[str, Any]] = []
    if caption is not None:
        sub = text_block(caption_bbox or bbox, caption, type="table_caption", index=index)
        sub["group_id"] = 0
        blocks.append(sub)
    blocks.append(
        {
            "type": "table_body",
            "bbox": body,
            "group_id": 0,
            "index": index,
            "lines": [_span_line(body, [span])],
        }
    )
    return {"type": "table", "bbox": list(bbox), "blocks": blocks, "index": index}


def image_block(
    bbox: Sequence[Any],
    *,
    image_path: str = "cd34.jpg",
    caption: str | None = None,
    caption_bbox: Sequence[Any] | None = None,
    body_bbox: Sequence[Any] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    """An ``image`` group: an ``image_body`` and an optional ``image_caption``."""
    body = list(body_bbox or bbox)
    span = {"bbox": body, "score": 1.0, "type": "image", "image_path": image_path}
    blocks: list[dict[str, Any]] = [
        {
            "type": "image_body",
            "bbox": body,
            "group_id": 0,
            "index": index,
            "lines": [_span_line(body, [span])],
        }
    ]
    if caption is not None:
        sub = text_block(caption_bbox or bbox, caption, type="image_caption", index=index)
        sub["group_id"] = 0
        blocks.append(sub)
    return {"type": "image", "bbox": list(bbox), "blocks": blocks, "index": index}


def _box(size: tuple[float, float], x0: float, y0: float, x1: float, y1: float) -> list[float]:
    width, height = size
    return [
        round(x0 * width, 2),
        round(y0 * height, 2),
        round(x1 * width, 2),
        round(y1 * height, 2),
    ]


def default_blocks(size: tuple[float, float], page_idx: int) -> list[dict[str, Any]]:
    """What the fake finds on every page: title, paragraph, equation, table, figure."""
    paragraph = text_block(_box(size, 0.1, 0.12, 0.9, 0.3), DEFAULT_TEXT, index=1)
    paragraph["lines"].append(
        _span_line(
            _box(size, 0.1, 0.2, 0.9, 0.3),
            [
                {
                    "bbox": _box(size, 0.1, 0.2, 0.3, 0.3),
                    "score": 1.0,
                    "type": "text",
                    "content": "Energy is",
                },
                {
                    "bbox": _box(size, 0.3, 0.2, 0.5, 0.3),
                    "score": 1.0,
                    "type": "inline_equation",
                    "content": "E=mc^2",
                },
            ],
            1,
        )
    )
    return [
        text_block(
            _box(size, 0.1, 0.05, 0.9, 0.1), f"Fake document, page {page_idx + 1}", type="title"
        ),
        paragraph,
        equation_block(_box(size, 0.3, 0.32, 0.7, 0.38), r"\int_0^1 x\,dx = \frac{1}{2}", index=2),
        table_block(
            _box(size, 0.1, 0.4, 0.9, 0.65),
            html="<table><tr><td>1</td><td>2</td></tr></table>",
            caption="Table 1: fake figures",
            caption_bbox=_box(size, 0.1, 0.4, 0.9, 0.43),
            body_bbox=_box(size, 0.1, 0.44, 0.9, 0.65),
            image_path=f"table{page_idx}.jpg",
            index=3,
        ),
        image_block(
            _box(size, 0.2, 0.7, 0.8, 0.9),
            image_path=f"figure{page_idx}.jpg",
            caption="Figure 1: a fake picture",
            caption_bbox=_box(size, 0.2, 0.87, 0.8, 0.9),
            body_bbox=_box(size, 0.2, 0.7, 0.8, 0.86),
            index=4,
        ),
    ]


@dataclass(frozen=True, slots=True)
class FakePage:
    """One page of a scripted layout. ``size`` goes into ``page_size`` verbatim (so a test
    can send a broken one); ``blocks=None`` means the default blocks for that size."""

    size: Any = (595.0, 842.0)
    blocks: Sequence[Mapping[str, Any]] | None = None


# --------------------------------------------------------------------------- replies


@dataclass(frozen=True, slots=True)
class Reply:
    """What the fake answers to one POST of a source. Build it with the class methods."""

    kind: ReplyKind = "ok"
    text: str | None = None
    """``/ocr/*`` content; ``None`` -> the default text (one paragraph per page)."""
    pages: tuple[FakePage, ...] | None = None
    """``/parse`` pages; ``None`` -> one default page per page of the upload."""
    message: str = ""
    status: int = 200
    body: bytes = b""
    content: str = ""
    content_type: str = ""
    delay_s: float = 0.0
    """Processing time of a successful answer (under the source's lock when ``serial``)."""
    zip_fault: ZipFault | None = None
    zip_padding: int = 0
    """Extra stored (uncompressed) bytes in the ZIP, to push it past a size cap."""
    middle_padding: int = 0
    """Whitespace appended to each middle.json: still valid JSON, but that many bytes bigger
    once decompressed (a decompression bomb; it compresses to almost nothing)."""
    download: DownloadMode = "ok"
    headers: tuple[tuple[str, str], ...] = ()
    """Extra response headers of a ``with_status`` answer."""

    @classmethod
    def ok(
        cls,
        text: str | None = None,
        *,
        pages: Sequence[FakePage] | None = None,
        delay_s: float = 0.0,
    ) -> Reply:
        return cls("ok", text=text, pages=None if pages is None else tuple(pages), delay_s=delay_s)

    @classmethod
    def ocr_failed(cls, message: str = "CUDA out of memory. Tried to allocate 2.00 GiB") -> Reply:
        """``/ocr/*``: HTTP 200 ``success:false``, ``"OCR task failed: <message>"``."""
        return cls("ocr_failed", message=message)

    @classmethod
    def parse_failed(cls, message: str = "name 'os' is not defined") -> Reply:
        """``/parse``: HTTP 500 ``{"detail": "Parsing failed: <message>"}``."""
        return cls("parse_failed", message=message)

    @classmethod
    def with_status(
        cls,
        status: int,
        body: bytes | str | Mapping[str, Any] = b"",
        *,
        headers: Mapping[str, str] | None = None,
    ) -> Reply:
        """Any status with any body and headers (a proxy's 502, FastAPI's 422, a redirect)."""
        if isinstance(body, Mapping):
            raw = json.dumps(body).encode()
        else:
            raw = body.encode() if isinstance(body, str) else body
        return cls("status", status=status, body=raw, headers=tuple((headers or {}).items()))

    @classmethod
    def reset(cls) -> Reply:
        """Close the connection without answering."""
        return cls("reset")

    @classmethod
    def inline(cls, content: str, content_type: str = "text/plain") -> Reply:
        """``/parse`` ``success:true`` with ``content`` (e.g. ``"No middle.json file found"``)."""
        return cls("content", content=content, content_type=content_type)

    @classmethod
    def zip(
        cls,
        fault: ZipFault | None = None,
        *,
        padding: int = 0,
        middle_padding: int = 0,
        download: DownloadMode = "ok",
        pages: Sequence[FakePage] | None = None,
    ) -> Reply:
        """A ``/parse`` success whose ZIP (or its download) is broken as asked."""
        return cls(
            "ok",
            pages=None if pages is None else tuple(pages),
            zip_fault=fault,
            zip_padding=padding,
            middle_padding=middle_padding,
            download=download,
        )


@dataclass(frozen=True, slots=True)
class ReceivedUpload:
    """One request as the fake saw it (the upload's digest, never a copy of big bodies)."""

    source: str
    method: str
    path: str
    query: Mapping[str, str]
    filename: str | None
    content_type: str | None
    size: int
    sha256: str


@dataclass
class _SourceState:
    model_loaded: bool = True
    variant: Variant = "return_type"
    serial: bool = False
    health_status: int = 200
    script: deque[Reply] = field(default_factory=deque)
    lock: asyncio.Lock | None = None
    inflight: int = 0
    max_inflight: int = 0


@dataclass(frozen=True, slots=True)
class _Stored:
    data: bytes
    download: DownloadMode


class _CountingServer(web.Server):
    """aiohttp's low-level server, telling the fake when a socket opens and closes."""

    def __init__(self, handler: Any, on_change: Callable[[int], None]) -> None:
        super().__init__(handler, handler_cancellation=True)
        self._on_change = on_change

    def connection_made(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        self._on_change(+1)

    def connection_lost(self, handler: RequestHandler, exc: BaseException | None = None) -> None:
        super().connection_lost(handler, exc)
        self._on_change(-1)


# --------------------------------------------------------------------------- the server


class FakeMonkeyOcr:
    """The fake MonkeyOCR server (see the module docstring)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._host = host
        self._port = port
        self._guard = threading.Condition()
        self._states: dict[str, _SourceState] = {}
        self._uploads: list[ReceivedUpload] = []
        self._zips: dict[tuple[str, str], _Stored] = {}
        self._downloads: list[tuple[str, str]] = []
        self._connections = 0
        self._stalled = 0
        self._runner: web.ServerRunner | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._release: asyncio.Event | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._release = asyncio.Event()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self._host, self._port))
        self._port = sock.getsockname()[1]
        self._runner = web.ServerRunner(
            _CountingServer(self._handle, self._count), handle_signals=False, shutdown_timeout=1.0
        )
        await self._runner.setup()
        await web.SockSite(self._runner, sock).start()

    async def stop(self) -> None:
        if self._release is not None:
            self._release.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> FakeMonkeyOcr:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @classmethod
    @contextmanager
    def in_thread(cls, host: str = "127.0.0.1", port: int = 0) -> Iterator[FakeMonkeyOcr]:
        """Run the fake on its own event loop in a daemon thread (serves any test loop).

        Returns once it listens (or raises why it could not); leaving the block stops it,
        cancels what it still runs and joins the thread."""
        fake = cls(host, port)
        with serve_in_thread(fake.start, fake.stop, name="pgw-fake-monkeyocr"):
            yield fake

    # ------------------------------------------------------------------ test API

    @property
    def port(self) -> int:
        return self._port

    def base_url(self, source: str = DEFAULT_SOURCE) -> str:
        """The ``base_url`` of logical source ``source``."""
        return f"http://{self._host}:{self._port}/{source}"

    def script(self, source: str, *replies: Reply) -> None:
        """Queue what the next POSTs of ``source`` answer (afterwards: the defaults)."""
        with self._guard:
            self._state(source).script.extend(replies)

    def configure(
        self,
        source: str,
        *,
        model_loaded: bool | None = None,
        variant: Variant | None = None,
        serial: bool | None = None,
        health_status: int | None = None,
    ) -> None:
        """Server-wide facts of ``source``: model loaded, API variant, one global lock."""
        with self._guard:
            state = self._state(source)
            if model_loaded is not None:
                state.model_loaded = model_loaded
            if variant is not None:
                state.variant = variant
            if serial is not None:
                state.serial = serial
            if health_status is not None:
                state.health_status = health_status

    def reset(self) -> None:
        """Forget scripts, settings, uploads and ZIPs; let stalled downloads finish."""
        with self._guard:
            self._states.clear()
            self._uploads.clear()
            self._zips.clear()
            self._downloads.clear()
            self._stalled = 0
            self._guard.notify_all()
        self._release_stalled()

    def uploads(self, source: str | None = None) -> list[ReceivedUpload]:
        with self._guard:
            return [u for u in self._uploads if source is None or u.source == source]

    def downloads(self, source: str | None = None) -> list[str]:
        """Names requested under ``GET /static/`` (of ``source``, or all), in order."""
        with self._guard:
            return [name for src, name in self._downloads if source is None or src == source]

    def max_inflight(self, source: str) -> int:
        """The most requests of ``source`` that were being processed at the same time."""
        with self._guard:
            return self._state(source).max_inflight

    @property
    def open_connections(self) -> int:
        """Client connections open right now (sockets, whatever they are doing)."""
        with self._guard:
            return self._connections

    @property
    def stalled_downloads(self) -> int:
        """Downloads (``download="stall"``) that sent part of the ZIP and are waiting."""
        with self._guard:
            return self._stalled

    def wait_until(
        self, predicate: Callable[[FakeMonkeyOcr], bool], within_s: float = 10.0
    ) -> None:
        """Block until ``predicate(self)`` holds (re-checked on every state change)."""
        with self._guard:
            if not self._guard.wait_for(lambda: predicate(self), within_s):
                raise TimeoutError(f"fake MonkeyOCR: condition not met within {within_s:g}s")

    async def wait_until_async(
        self, predicate: Callable[[FakeMonkeyOcr], bool], within_s: float = 10.0
    ) -> None:
        """``wait_until`` without blocking the caller's event loop."""
        await asyncio.to_thread(self.wait_until, predicate, within_s)

    def release_stalled(self) -> None:
        """Let every stalled download send the rest of its ZIP."""
        self._release_stalled()

    # ------------------------------------------------------------------ internals

    def _state(self, source: str) -> _SourceState:
        state = self._states.get(source)
        if state is None:
            state = self._states[source] = _SourceState()
        return state

    def _count(self, delta: int) -> None:
        with self._guard:
            self._connections += delta
            self._guard.notify_all()

    def _release_stalled(self) -> None:
        loop, event = self._loop, self._release
        if loop is None or event is None or loop.is_closed():
            return

        def swap() -> None:
            old = self._release
            self._release = asyncio.Event()
            if old is not None:
                old.set()

        if _running_loop() is loop:
            swap()
        else:
            with suppress(RuntimeError):  # the loop is shutting down
                loop.call_soon_threadsafe(swap)

    def _next_reply(self, state: _SourceState) -> Reply:
        """The next scripted reply of the source state a request arrived under: a request
        still being read when a test resets the fake (a timed-out upload of the test before)
        takes nothing of the next test's script."""
        with self._guard:
            script = state.script
            return script.popleft() if script else Reply()

    @staticmethod
    def _json(payload: Any, status: int = 200) -> web.Response:
        return web.Response(
            status=status, body=json.dumps(payload).encode(), content_type="application/json"
        )

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        source, _, rest = request.path.lstrip("/").partition("/")
        route = "/" + rest
        with self._guard:
            state = self._state(source)
        if request.method == "GET":
            if route == "/":
                if state.variant == "dashboard":
                    raise web.HTTPTemporaryRedirect(f"/{source}/dashboard")
                return self._json({"message": "MonkeyOCR API is running", "version": "1.0.0"})
            if route == "/health":
                return self._json(
                    {"status": "healthy", "model_loaded": state.model_loaded}, state.health_status
                )
            if route.startswith("/static/"):
                return await self._static(request, source, route[len("/static/") :])
        elif request.method == "POST":
            if route in ("/ocr/text", "/ocr/formula", "/ocr/table"):
                return await self._serve(request, source, state, route)
            if route in ("/parse", "/parse/split"):
                return await self._serve(request, source, state, route)
        known = route in (
            "/",
            "/health",
            "/ocr/text",
            "/ocr/formula",
            "/ocr/table",
            "/parse",
            "/parse/split",
        )
        if known:
            return self._json({"detail": "Method Not Allowed"}, 405)
        return self._json({"detail": "Not Found"}, 404)

    async def _read_upload(
        self, request: web.BaseRequest, source: str, route: str
    ) -> tuple[str | None, bytes, bool]:
        """``(filename, body, found)`` of the multipart field ``file``: the body whole when it
        is small, else its head (the upload is hashed as it streams, never held twice)."""
        filename: str | None = None
        content_type: str | None = None
        found = False
        digest = hashlib.sha256()
        size = 0
        kept = bytearray()
        if request.content_type.startswith("multipart/"):
            reader = await request.multipart()
            while (part := await reader.next()) is not None:
                if not isinstance(part, BodyPartReader) or part.name != "file" or found:
                    await part.release()
                    continue
                found = True
                filename = part.filename
                content_type = part.headers.get("Content-Type")
                keep = _HEAD_BYTES
                while chunk := await part.read_chunk(64 * 1024):
                    if not size and b"%PDF-" in chunk[:1024]:
                        keep = _KEEP_BODY_BYTES  # page sizes are read from the whole PDF
                    digest.update(chunk)
                    size += len(chunk)
                    if len(kept) < keep:
                        kept += chunk[: keep - len(kept)]
        upload = ReceivedUpload(
            source=source,
            method=request.method,
            path=route,
            query=dict(request.query),
            filename=filename,
            content_type=content_type,
            size=size,
            sha256=digest.hexdigest(),
        )
        with self._guard:
            self._uploads.append(upload)
            self._guard.notify_all()
        return filename, bytes(kept), found

    async def _serve(
        self, request: web.BaseRequest, source: str, state: _SourceState, route: str
    ) -> web.StreamResponse:
        filename, body, found = await self._read_upload(request, source, route)
        if not found:
            missing = {"type": "missing", "loc": ["body", "file"], "msg": "Field required"}
            return self._json({"detail": [{**missing, "input": None}]}, 422)
        reply = self._next_reply(state)
        if reply.kind == "reset":
            if request.transport is not None:
                request.transport.abort()
            return web.Response(status=500)  # never reaches the client: the socket is gone
        if reply.kind == "status":
            return web.Response(
                status=reply.status,
                body=reply.body,
                content_type="application/json",
                headers=dict(reply.headers),
            )
        task = route.rpartition("/")[2]
        ocr = route.startswith("/ocr/")
        extension = _extension(filename)
        error: str | None = None
        if not state.model_loaded:
            error = "500: Model not initialized"
        elif extension not in ALLOWED_EXTENSIONS:
            # The server builds the list from a set: its order varies between processes.
            allowed = ", ".join(ALLOWED_EXTENSIONS)
            error = f"400: Unsupported file type: {extension}. Allowed: {allowed}"
        elif reply.kind in ("ocr_failed", "parse_failed"):
            error = reply.message
        if error is not None:
            if ocr:
                return self._json(
                    {
                        "success": False,
                        "task_type": task,
                        "content": "",
                        "message": f"OCR task failed: {error}",
                    }
                )
            return self._json({"detail": f"Parsing failed: {error}"}, 500)
        await self._enter(state)
        try:
            if reply.delay_s:
                await asyncio.sleep(reply.delay_s)  # "inference", under the lock if serial
            if ocr:
                text = reply.text if reply.text is not None else _default_text(extension, body)
                return self._json(
                    {
                        "success": True,
                        "task_type": task,
                        "content": text,
                        "message": f"{task.capitalize()} extraction completed successfully",
                    }
                )
            return self._parse(request, source, state, reply, extension, body, route)
        finally:
            self._leave(state)

    async def _enter(self, state: _SourceState) -> None:
        if state.serial:
            if state.lock is None:
                state.lock = asyncio.Lock()
            await state.lock.acquire()
        with self._guard:
            state.inflight += 1
            state.max_inflight = max(state.max_inflight, state.inflight)

    def _leave(self, state: _SourceState) -> None:
        with self._guard:
            state.inflight -= 1
        if state.serial and state.lock is not None and state.lock.locked():
            state.lock.release()

    def _parse(
        self,
        request: web.BaseRequest,
        source: str,
        state: _SourceState,
        reply: Reply,
        extension: str,
        body: bytes,
        route: str,
    ) -> web.StreamResponse:
        split = route.endswith("/split")
        newer = state.variant == "return_type"
        return_type = request.query.get("return_type", "zip_all") if newer else "zip_all"
        pages = (
            list(reply.pages)
            if reply.pages is not None
            else [FakePage(size) for size in _page_sizes_of(extension, body)]
        )
        original = "upload"
        unique = uuid.uuid4().hex[:8]
        safe = f"{original}_{uuid.uuid4().hex[:8]}"
        result = _ResultFiles.build(pages, original, safe, split, reply.middle_padding)
        kind = "PDF" if extension == ".pdf" else "image"
        how = "with page splitting" if split else "standard"
        response: dict[str, Any] = {
            "success": True,
            "message": f"{kind} parsing ({how}) completed successfully",
            "output_dir": f"/tmp/monkeyocr_parse_{unique}_{uuid.uuid4().hex[:8]}/{safe}",
            "files": result.raw_names,
            "download_url": None,
        }
        if newer:
            response["content"] = None
            response["content_type"] = None
        if reply.kind == "content":
            response["content"] = reply.content
            response["content_type"] = reply.content_type
            response["message"] += f" - returning {return_type}"
            return self._json(response)
        if return_type in ("zip_all", "zip_markdown"):
            suffix = "_split" if split else "_parsed"
            name = f"{original}{suffix}_{int(time.time() * 1000)}_{unique}.zip"
            data = result.zip(markdown_only=return_type == "zip_markdown", reply=reply)
            with self._guard:
                self._zips[(source, name)] = _Stored(data, reply.download)
            response["download_url"] = f"/static/{name}"
            return self._json(response)
        content, content_type = result.specific(return_type)
        response["message"] += f" - returning {return_type}"
        response["content"] = content
        response["content_type"] = content_type
        return self._json(response)

    async def _static(self, request: web.BaseRequest, source: str, name: str) -> web.StreamResponse:
        with self._guard:
            stored = self._zips.get((source, name))
            self._downloads.append((source, name))
        if stored is None or stored.download == "gone":
            return self._json({"detail": "Not Found"}, 404)
        response = web.StreamResponse(status=200)
        response.content_type = "application/zip"
        if stored.download == "announce_huge":
            response.content_length = 1 << 40
            await response.prepare(request)
            await response.write(stored.data[:1024])
            release = self._release
            if release is not None:
                await release.wait()
            return response
        response.content_length = len(stored.data)
        await response.prepare(request)
        if stored.download == "stall":
            half = len(stored.data) // 2
            await response.write(stored.data[:half])
            release = self._release
            with self._guard:
                self._stalled += 1
                self._guard.notify_all()
            try:
                if release is not None:
                    await release.wait()
            finally:
                with self._guard:
                    self._stalled -= 1
                    self._guard.notify_all()
            await response.write(stored.data[half:])
        else:
            await response.write(stored.data)
        await response.write_eof()
        return response


@dataclass(frozen=True, slots=True)
class _ResultFiles:
    """The files MonkeyOCR writes for one parse, by raw name, and how they go into the ZIP."""

    files: tuple[tuple[str, str, bytes], ...]
    """(raw name as in ``files[]``, name in the ZIP, bytes)."""
    middles: tuple[bytes, ...]
    content_lists: tuple[bytes, ...]

    @property
    def raw_names(self) -> list[str]:
        return [raw for raw, _zip, _data in self.files]

    @classmethod
    def build(
        cls,
        pages: Sequence[FakePage],
        original: str,
        safe: str,
        split: bool,
        middle_padding: int,
    ) -> _ResultFiles:
        files: list[tuple[str, str, bytes]] = []
        middles: list[bytes] = []
        lists: list[bytes] = []
        groups = (
            [[(i, p) for i, p in enumerate(pages)]]
            if not split
            else [[(i, p)] for i, p in enumerate(pages)]
        )
        for group in groups:
            if split:
                index = group[0][0]
                stem = f"{safe}_page_{index}"
                raw_dir, zip_dir, zip_stem = (
                    f"page_{index}/",
                    f"page_{index}/",
                    f"{original}_{stem}",
                )
            else:
                stem, raw_dir, zip_dir, zip_stem = safe, "", "", original
            # Each split page is its own document: its page_idx restarts at 0.
            infos = [_page_info(page, 0 if split else index, index) for index, page in group]
            middle = (
                json.dumps(
                    {"pdf_info": infos, "_parse_type": "ocr", "_version_name": "1.1.0"}
                ).encode()
                + b" " * middle_padding
            )
            content_list = json.dumps(_content_list(infos)).encode()
            markdown = _markdown(infos).encode()
            middles.append(middle)
            lists.append(content_list)
            for suffix, data in (
                (".md", markdown),
                ("_content_list.json", content_list),
                ("_middle.json", middle),
                ("_model.pdf", _FAKE_PDF),
                ("_layout.pdf", _FAKE_PDF),
                ("_spans.pdf", _FAKE_PDF),
            ):
                files.append((f"{raw_dir}{stem}{suffix}", f"{zip_dir}{zip_stem}{suffix}", data))
            for image in sorted(_image_paths(infos)):
                files.append((f"{raw_dir}images/{image}", f"{zip_dir}images/{image}", _FAKE_JPEG))
        return cls(tuple(files), tuple(middles), tuple(lists))

    def zip(self, *, markdown_only: bool, reply: Reply) -> bytes:
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
            for _raw, name, data in self.files:
                if markdown_only and not (name.endswith(".md") or "images/" in name):
                    continue
                if name.endswith("_middle.json"):
                    if reply.zip_fault == "no_middle":
                        continue
                    if reply.zip_fault == "bad_json":
                        data = b'{"pdf_info": [{"page_idx": 0, "page_size": [595, 8'
                archive.writestr(name, data)
            if reply.zip_fault == "traversal":
                evil = json.dumps({"pdf_info": [{"page_idx": 0, "page_size": [1, 1]}]}).encode()
                archive.writestr("../../outside_middle.json", evil)
                archive.writestr("/etc/absolute_middle.json", evil)
            if reply.zip_padding:
                archive.writestr(
                    zipfile.ZipInfo("images/padding.bin"),
                    bytes(reply.zip_padding),
                    compress_type=zipfile.ZIP_STORED,
                )
        data = out.getvalue()
        if reply.zip_fault == "corrupt":
            return data[: len(data) // 2]
        return data

    def specific(self, return_type: str) -> tuple[str, str]:
        """What ``get_specific_content`` answers for a non-ZIP ``return_type``."""
        if return_type == "middle_json":
            return (
                (self.middles[0].decode(), "application/json")
                if self.middles
                else (
                    "No middle.json file found",
                    "text/plain",
                )
            )
        if return_type == "content_list_json":
            return self.content_lists[0].decode(), "application/json"
        if return_type in ("model_pdf", "layout_pdf", "spans_pdf"):
            return base64.b64encode(_FAKE_PDF).decode(), "application/pdf"
        return f"Unknown return_type: {return_type}", "text/plain"


def _page_info(page: FakePage, page_idx: int, number: int) -> dict[str, Any]:
    """A ``pdf_info`` page; ``number`` is its place in the upload (for the default text)."""
    size = page.size
    blocks: list[Any]
    if page.blocks is not None:
        blocks = [dict(b) for b in page.blocks]
    elif isinstance(size, Sequence) and len(size) == 2:
        blocks = default_blocks((float(size[0]), float(size[1])), number)
    else:
        blocks = []
    return {
        "preproc_blocks": blocks,
        "layout_bboxes": [],
        "page_idx": page_idx,
        "page_size": list(size) if isinstance(size, Sequence) else size,
        "_layout_tree": [],
        "images": [],
        "tables": [],
        "interline_equations": [],
        "discarded_blocks": [],
        "need_drop": False,
        "drop_reason": [],
        "para_blocks": blocks,
    }


def _walk_spans(block: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    for sub in block.get("blocks") or ():
        yield from _walk_spans(sub)
    for line in block.get("lines") or ():
        yield from line.get("spans") or ()


def _image_paths(infos: Sequence[Mapping[str, Any]]) -> set[str]:
    found: set[str] = set()
    for info in infos:
        for block in info["para_blocks"]:
            if isinstance(block, Mapping):
                for span in _walk_spans(block):
                    if isinstance(span, Mapping) and isinstance(span.get("image_path"), str):
                        found.add(span["image_path"])
    return found


def _plain(block: Mapping[str, Any]) -> str:
    parts = []
    for span in _walk_spans(block):
        content = span.get("content") if isinstance(span, Mapping) else None
        if isinstance(content, str):
            parts.append(f"${content}$" if span.get("type") == "inline_equation" else content)
    return " ".join(parts)


def _content_list(infos: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    for info in infos:
        for block in info["para_blocks"]:
            if not isinstance(block, Mapping):
                continue
            kind, page = block.get("type"), info["page_idx"]
            subs = [b for b in block.get("blocks") or () if isinstance(b, Mapping)]
            if kind == "interline_equation":
                items.append(
                    {
                        "type": "equation",
                        "text": _plain(block),
                        "text_format": "latex",
                        "page_idx": page,
                    }
                )
            elif kind == "image":
                items.append(
                    {
                        "type": "image",
                        "img_path": "",
                        "img_caption": [
                            _plain(b) for b in subs if b.get("type") == "image_caption"
                        ],
                        "img_footnote": [],
                        "page_idx": page,
                    }
                )
            elif kind == "table":
                html = next(
                    (s.get("html") for b in subs for s in _walk_spans(b) if s.get("html")), ""
                )
                items.append(
                    {
                        "type": "table",
                        "img_path": "",
                        "table_caption": [
                            _plain(b) for b in subs if b.get("type") == "table_caption"
                        ],
                        "table_footnote": [],
                        "table_body": f"\n\n{html}\n\n",
                        "page_idx": page,
                    }
                )
            else:
                item: dict[str, Any] = {"type": "text", "text": _plain(block), "page_idx": page}
                if kind == "title":
                    item["text_level"] = 1
                items.append(item)
    return items


def _markdown(infos: Sequence[Mapping[str, Any]]) -> str:
    out: list[str] = []
    for item in _content_list(infos):
        if item["type"] == "text":
            out.append(("# " if item.get("text_level") else "") + item["text"])
        elif item["type"] == "equation":
            out.append(f"$$\n{item['text']}\n$$")
        elif item["type"] == "table":
            out.extend([*item["table_caption"], item["table_body"].strip()])
        elif item["type"] == "image":
            out.extend(item["img_caption"])
    return "\n\n".join(out)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _extension(filename: str | None) -> str:
    if not filename or "." not in filename:
        return ""
    return "." + filename.rsplit(".", 1)[1].lower()


def _default_text(extension: str, body: bytes) -> str:
    pages = len(_page_sizes_of(extension, body))
    if pages == 1:
        return DEFAULT_TEXT
    return "\n\n".join(f"{DEFAULT_TEXT} (page {i + 1})" for i in range(pages))
