"""``MonkeyOcrTransport``: the OCR ports over one MonkeyOCR server (one instance per source).

- ``recognize_text(image)``: ``POST /ocr/text`` (multipart field ``file``, named after what the
  bytes are) -> ``OcrTextResult`` (pages joined by blank lines; empty text = nothing found).
- ``parse_layout(image)``: ``POST /parse`` (or ``/parse/split``) -> ``download_url`` ->
  ``GET /static/...`` ZIP -> ``*_middle.json`` -> ``OcrLayoutResult`` with elements, per-page
  sizes and the rejected bboxes. Servers that know ``return_type`` may answer the middle.json
  inline instead (option ``return_type = "middle_json"``).
- ``check_health()``: ``GET /health``; healthy only with ``model_loaded: true``. Never raises.

One attempt, no retry, no limits: governance belongs to the caller. Every failure is one of the
four error classes (``pgw_monkeyocr.classify``). Each call runs under one deadline that grows
with the input: ``timeout_s + pages x per_page_timeout_s + MiB x per_mb_timeout_s``, at most
``max_timeout_s`` (MonkeyOCR has no server-side timeout and runs about 0.5-2.4 pages/s per
GPU). Cancellation propagates and
closes any connection whose response was not completely read.

The upload is written from the caller's bytes in slices of a ``memoryview``: a 50 MB scan is
never copied a second time (neither by the multipart encoder nor into the socket buffer).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any, Final
from urllib.parse import urlsplit

import aiohttp
from aiohttp import payload as aiohttp_payload
from polygateway.clock import SystemClock
from polygateway.errors import (
    ConfigError,
    PolyGatewayError,
    ResultInvalidError,
    TransientError,
)
from polygateway.ports import Clock
from polygateway.settings import SourceConfig
from polygateway.transports.errors import sanitize_message, wire_error
from polygateway.transports.openai_compat import source_secrets
from polygateway.types import OcrLayoutResult, OcrTextResult, Usage

from pgw_monkeyocr.archive import Layout, parse_middle_document, parse_zip
from pgw_monkeyocr.classify import failure_error, status_error
from pgw_monkeyocr.middle import invalid
from pgw_monkeyocr.options import MIB, MonkeyOcrOptions
from pgw_monkeyocr.sniff import Upload, describe_upload

logger = logging.getLogger(__name__)

UPLOAD_CHUNK: Final = 256 * 1024
"""Bytes handed to the socket per write; the transport buffers at most about this much."""


class _ViewPayload(aiohttp_payload.Payload):
    """The caller's bytes as a multipart part, written in ``memoryview`` slices (no copy)."""

    def __init__(self, data: bytes, upload: Upload) -> None:
        super().__init__(data, content_type=upload.content_type, filename=upload.filename)
        self._view = memoryview(data)
        self._size = len(data)

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return bytes(self._view).decode(encoding, errors)

    async def write(self, writer: Any) -> None:
        await self.write_with_length(writer, None)

    async def write_with_length(self, writer: Any, content_length: int | None) -> None:
        view = self._view
        end = len(view) if content_length is None else min(len(view), content_length)
        for start in range(0, end, UPLOAD_CHUNK):
            await writer.write(view[start : min(start + UPLOAD_CHUNK, end)])


class MonkeyOcrTransport:
    """``OcrTextPort`` and ``OcrLayoutPort`` over the MonkeyOCR server of ``source``."""

    def __init__(self, source: SourceConfig, *, clock: Clock | None = None) -> None:
        base_url = source.base_url.strip().rstrip("/")
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(
                f"source {source.name!r}: base_url must be an http(s) URL, got "
                f"{sanitize_message(base_url)!r}"
            )
        self._source = source
        self._base_url = base_url
        self._origin = (parts.scheme, parts.netloc)
        self._options = MonkeyOcrOptions.from_source(source)
        self._clock: Clock = clock or SystemClock()
        self._secret = source.api_key.reveal() or None
        # Masked out of every message: the key, a URL password, credential-looking headers.
        self._secrets = source_secrets(source)
        self._session: aiohttp.ClientSession | None = None

    # ------------------------------------------------------------------ properties

    @property
    def source(self) -> SourceConfig:
        return self._source

    @property
    def source_name(self) -> str:
        return self._source.name

    @property
    def options(self) -> MonkeyOcrOptions:
        return self._options

    def timeout_for(self, image: bytes) -> float:
        """The deadline of one call on ``image``: the base total plus the input's allowance."""
        upload = describe_upload(image, source_name=self.source_name)
        return self._deadline_s(upload, len(image))

    @property
    def max_deadline_s(self) -> float:
        """The longest any call of this source may take (what leases must outlive)."""
        return max(self._source.timeout_s, self._options.max_timeout_s)

    def _deadline_s(self, upload: Upload, size: int) -> float:
        options = self._options
        scaled = (
            self._source.timeout_s
            + upload.pages * options.per_page_timeout_s
            + size / MIB * options.per_mb_timeout_s
        )
        return min(scaled, self.max_deadline_s)

    # ------------------------------------------------------------------ session

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            headers = dict(self._options.headers)
            if self._secret:
                headers["Authorization"] = f"Bearer {self._secret}"
            connect = self._source.connect_timeout_s
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._options.max_connections),
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=None, connect=connect, sock_connect=connect),
                trust_env=self._options.trust_env,
                raise_for_status=False,
                auto_decompress=True,
            )
        return self._session

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    # ------------------------------------------------------------------ wire helpers

    @asynccontextmanager
    async def _wire(self, limit_s: float, what: str) -> AsyncIterator[None]:
        """Run a whole call under ``limit_s`` and translate wire failures."""
        try:
            async with asyncio.timeout(limit_s):
                yield
        except TimeoutError as exc:  # before OSError: TimeoutError is one
            raise TransientError(
                f"source {self.source_name!r}: {what} gave no complete answer within {limit_s:g}s",
                source_name=self.source_name,
                reason="timeout",
            ) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise wire_error(
                exc, timeout=False, source_name=self.source_name, secret=self._secrets
            ) from exc

    async def _read_body(
        self, response: aiohttp.ClientResponse, cap: int, what: str, *, cap_error: bool
    ) -> bytes:
        """The whole body, refusing more than ``cap`` bytes (before reading when the length is
        announced). Over the cap: ``TransientError`` naming it when ``cap_error``, else
        ``ResultInvalidError``."""
        announced = response.content_length
        if announced is not None and announced > cap:
            raise self._over_cap(what, cap, f"announces {announced} bytes", cap_error)
        parts: list[bytes] = []
        size = 0
        while chunk := await response.content.readany():
            size += len(chunk)
            if size > cap:
                raise self._over_cap(what, cap, f"runs past {cap} bytes", cap_error)
            parts.append(chunk)
        return b"".join(parts)

    def _over_cap(self, what: str, cap: int, detail: str, cap_error: bool) -> Exception:
        message = f"source {self.source_name!r}: the {what} {detail}, over the {cap}-byte cap"
        if cap_error:
            return TransientError(
                f"{message} (option max_zip_mb={cap / MIB:g})", source_name=self.source_name
            )
        return ResultInvalidError(message)

    @staticmethod
    def _finish(response: aiohttp.ClientResponse) -> None:
        """Give the connection back when the body was read to the end, close it otherwise."""
        if response.content.at_eof():
            response.release()
        else:
            response.close()

    async def _exchange(
        self,
        method: str,
        url: str,
        *,
        cap: int,
        what: str,
        data: Any = None,
        params: Mapping[str, str] | None = None,
        cap_error: bool = False,
    ) -> tuple[int, Mapping[str, str], bytes]:
        # Redirects are never followed: they would carry the upload and the Authorization
        # header elsewhere; a 3xx means a wrong base_url (SourceDeadError).
        response = await self._client().request(
            method, url, data=data, params=params, allow_redirects=False
        )
        try:
            body = await self._read_body(response, cap, what, cap_error=cap_error)
            return response.status, response.headers, body
        finally:
            self._finish(response)

    def _multipart(self, image: bytes, upload: Upload) -> aiohttp.MultipartWriter:
        writer = aiohttp.MultipartWriter("form-data")
        part = writer.append_payload(_ViewPayload(image, upload))
        part.set_content_disposition("form-data", name="file", filename=upload.filename)
        return writer

    def _json(self, body: bytes, what: str) -> Mapping[str, Any]:
        try:
            payload = json.loads(body)
        except ValueError:
            payload = None
        if not isinstance(payload, Mapping):
            raise ResultInvalidError(
                f"source {self.source_name!r}: the {what} answer is not a JSON object",
                raw_text=body[:2000].decode("utf-8", "replace"),
            )
        return payload

    def _usage(self, started: float) -> Usage:
        return Usage(elapsed_ms=max(0, round((self._clock.monotonic() - started) * 1000)))

    # ------------------------------------------------------------------ ports

    async def recognize_text(self, image: bytes) -> OcrTextResult:
        """Plain text of every page of ``image`` (PDF, PNG or JPEG)."""
        upload = describe_upload(image, source_name=self.source_name)
        limit = self._deadline_s(upload, len(image))
        started = self._clock.monotonic()
        async with self._wire(limit, "/ocr/text"):
            status, headers, body = await self._exchange(
                "POST",
                f"{self._base_url}/ocr/text",
                data=self._multipart(image, upload),
                cap=self._options.max_member_bytes,
                what="/ocr/text answer",
            )
        if status != 200:
            raise status_error(
                status,
                body,
                headers,
                endpoint="/ocr/text",
                source_name=self.source_name,
                secret=self._secrets,
            )
        payload = self._json(body, "/ocr/text")
        if payload.get("success") is not True:
            message = str(payload.get("message") or "no message")
            raise failure_error(
                message,
                endpoint="/ocr/text",
                status=status,
                source_name=self.source_name,
                secret=self._secrets,
            )
        content = payload.get("content")
        if not isinstance(content, str):
            raise ResultInvalidError(
                f"source {self.source_name!r}: /ocr/text answered success without a text 'content'",
                raw_text=body[:2000].decode("utf-8", "replace"),
            )
        return OcrTextResult(
            text=content, source_name=self.source_name, usage=self._usage(started), raw=payload
        )

    async def parse_layout(self, image: bytes) -> OcrLayoutResult:
        """Layout elements (bboxes in page coordinates), per-page sizes and provenance."""
        upload = describe_upload(image, source_name=self.source_name)
        options = self._options
        limit = self._deadline_s(upload, len(image))
        endpoint = "/parse/split" if options.mode == "split" else "/parse"
        params = {"return_type": options.return_type} if options.return_type != "zip_all" else None
        started = self._clock.monotonic()
        async with self._wire(limit, endpoint):
            status, headers, body = await self._exchange(
                "POST",
                f"{self._base_url}{endpoint}",
                data=self._multipart(image, upload),
                params=params,
                cap=options.max_member_bytes,
                what=f"{endpoint} answer",
            )
            if status != 200:
                raise status_error(
                    status,
                    body,
                    headers,
                    endpoint=endpoint,
                    source_name=self.source_name,
                    secret=self._secrets,
                )
            payload = self._json(body, endpoint)
            if payload.get("success") is not True:
                message = str(payload.get("message") or payload.get("detail") or "no message")
                raise failure_error(
                    message,
                    endpoint=endpoint,
                    status=status,
                    source_name=self.source_name,
                    secret=self._secrets,
                )
            download_url = payload.get("download_url")
            zip_bytes = 0
            if isinstance(download_url, str) and download_url:
                archive = await self._download(download_url)
                zip_bytes = len(archive)
                layout = await asyncio.to_thread(
                    parse_zip,
                    archive,
                    tolerance=options.bbox_tolerance,
                    member_cap=options.max_member_bytes,
                )
            else:
                layout = await asyncio.to_thread(self._inline_layout, payload, endpoint)
        return self._layout_result(layout, payload, zip_bytes, started)

    async def _download(self, download_url: str) -> bytes:
        status, headers, body = await self._exchange(
            "GET",
            self._resolve(download_url),
            cap=self._options.max_zip_bytes,
            what="result ZIP",
            cap_error=True,
        )
        if status != 200:
            raise status_error(
                status,
                body,
                headers,
                endpoint="download",
                source_name=self.source_name,
                secret=self._secrets,
            )
        return body

    def _resolve(self, download_url: str) -> str:
        """``/static/x.zip`` is relative to the server: joined to ``base_url`` (which keeps a
        reverse proxy's path prefix). An absolute URL must point at the same origin."""
        if download_url.startswith("/") and not download_url.startswith("//"):
            return f"{self._base_url}{download_url}"
        parts = urlsplit(download_url)
        if (parts.scheme, parts.netloc) != self._origin:
            raise ResultInvalidError(
                f"source {self.source_name!r}: download_url {sanitize_message(download_url)!r} "
                "points away from the server; refused"
            )
        return download_url

    def _inline_layout(self, payload: Mapping[str, Any], endpoint: str) -> Layout:
        """The ``return_type=middle_json`` answer: the JSON in ``content``."""
        content = payload.get("content")
        content_type = str(payload.get("content_type") or "")
        if not isinstance(content, str) or not content:
            raise invalid(f"{endpoint} answered success with neither download_url nor content")
        if not content_type.startswith("application/json"):
            # "No middle.json file found", "Unknown return_type: X": a message, not a layout.
            raise invalid(
                f"{endpoint} answered {content_type or 'untyped'} content instead of a layout: "
                f"{sanitize_message(content, limit=200)!r}",
                raw_text=content[:2000],
            )
        try:
            document = json.loads(content)
        except ValueError as exc:
            raise invalid(f"{endpoint} content is not valid JSON ({exc})", content[:2000]) from None
        pages = parse_middle_document(
            document, tolerance=self._options.bbox_tolerance, what=f"{endpoint} content"
        )
        return Layout(pages, document, "", (), ())

    def _layout_result(
        self, layout: Layout, payload: Mapping[str, Any], zip_bytes: int, started: float
    ) -> OcrLayoutResult:
        raw = {
            "response": dict(payload),
            "middle": layout.middle,
            "markdown": layout.markdown,
            "entries": list(layout.entries),
            "skipped_entries": list(layout.skipped_entries),
            "zip_bytes": zip_bytes,
        }
        return OcrLayoutResult(
            elements=tuple(e for page in layout.pages for e in page.elements),
            page_sizes=tuple(page.size for page in layout.pages),
            source_name=self.source_name,
            usage=self._usage(started),
            raw=raw,
            bbox_issues=tuple(i for page in layout.pages for i in page.issues),
        )

    async def check_health(self) -> bool:
        """``GET /health`` answers 200 with ``model_loaded: true``. Any failure is ``False``."""
        try:
            async with asyncio.timeout(self._options.health_timeout_s):
                status, _headers, body = await self._exchange(
                    "GET", f"{self._base_url}/health", cap=64 * 1024, what="/health answer"
                )
        except (TimeoutError, aiohttp.ClientError, OSError, PolyGatewayError) as exc:
            logger.info("source %r: health check failed: %s", self.source_name, type(exc).__name__)
            return False
        if status != 200:
            logger.info("source %r: health check answered HTTP %d", self.source_name, status)
            return False
        try:
            payload = json.loads(body)
        except ValueError:
            return False
        healthy = isinstance(payload, Mapping) and payload.get("model_loaded") is True
        if not healthy:
            logger.info("source %r: health check: model not loaded", self.source_name)
        return healthy


__all__ = ["UPLOAD_CHUNK", "MonkeyOcrTransport"]
