"""``recognize_text`` over ``POST /ocr/text`` against the fake MonkeyOCR server."""

from __future__ import annotations

import hashlib

import pytest
from pgw_monkeyocr.testing import DEFAULT_TEXT, FakeMonkeyOcr, Reply, make_jpeg, make_pdf, make_png
from pgw_monkeyocr_test_helpers import MakeTransport
from polygateway.errors import (
    RequestRejectedError,
    ResultInvalidError,
    SourceDeadError,
    TransientError,
)
from polygateway.settings import Secret


@pytest.mark.parametrize(
    ("image", "filename", "content_type"),
    [
        (make_png(64, 32), "upload.png", "image/png"),
        (make_jpeg(64, 32), "upload.jpg", "image/jpeg"),
        (make_pdf(), "upload.pdf", "application/pdf"),
        (b"junk before the header " + make_pdf(), "upload.pdf", "application/pdf"),
    ],
    ids=["png", "jpeg", "pdf", "pdf-after-junk"],
)
async def test_text_round_trip_names_the_file_after_its_magic_number(
    fake_monkeyocr: FakeMonkeyOcr,
    make_transport: MakeTransport,
    image: bytes,
    filename: str,
    content_type: str,
) -> None:
    transport = make_transport("a")
    result = await transport.recognize_text(image)
    assert result.text == DEFAULT_TEXT
    assert result.source_name == "monkey-a"
    assert result.usage.prompt_tokens == 0 and result.usage.completion_tokens == 0
    assert result.usage.elapsed_ms >= 0
    assert result.raw["task_type"] == "text"
    assert result.raw["message"] == "Text extraction completed successfully"
    (upload,) = fake_monkeyocr.uploads("a")
    assert (upload.method, upload.path) == ("POST", "/ocr/text")
    assert upload.filename == filename
    assert upload.content_type == content_type
    assert upload.size == len(image)
    assert upload.sha256 == hashlib.sha256(image).hexdigest()


async def test_pages_of_a_pdf_come_joined_by_blank_lines(make_transport: MakeTransport) -> None:
    result = await make_transport("a").recognize_text(make_pdf([(595, 842)] * 3))
    assert result.text.split("\n\n") == [f"{DEFAULT_TEXT} (page {i})" for i in (1, 2, 3)]


async def test_an_empty_page_is_an_empty_result_not_an_error(
    fake_monkeyocr: FakeMonkeyOcr, make_transport: MakeTransport
) -> None:
    fake_monkeyocr.script("a", Reply.ok(""))
    result = await make_transport("a").recognize_text(make_png())
    assert result.text == ""
    assert result.raw["success"] is True


@pytest.mark.parametrize(
    ("reply", "error", "needle"),
    [
        (
            Reply.ocr_failed("400: Unsupported file type: .tif. Allowed: .png, .jpg, .pdf, .jpeg"),
            RequestRejectedError,
            "Unsupported file type",
        ),
        (
            Reply.ocr_failed("CUDA out of memory. Tried to allocate 2.00 GiB"),
            TransientError,
            "CUDA",
        ),
        (Reply.ocr_failed("name 'os' is not defined"), TransientError, "name 'os'"),
        (
            Reply.with_status(422, {"detail": [{"msg": "Field required"}]}),
            RequestRejectedError,
            "422",
        ),
        (Reply.with_status(503, "Service Unavailable"), TransientError, "503"),
        (Reply.with_status(502, "<html>Bad Gateway</html>"), TransientError, "502"),
        (Reply.with_status(401, {"detail": "Not authenticated"}), SourceDeadError, "401"),
        (Reply.with_status(200, "<html>captive portal</html>"), ResultInvalidError, "JSON"),
        (
            Reply.with_status(200, {"success": True, "task_type": "text"}),
            ResultInvalidError,
            "content",
        ),
        (Reply.reset(), TransientError, "network error"),
    ],
    ids=[
        "unsupported-type",
        "cuda-oom",
        "server-bug",
        "422",
        "503",
        "502-html",
        "401",
        "200-not-json",
        "200-no-content",
        "reset",
    ],
)
async def test_failures_map_to_the_error_classes(
    fake_monkeyocr: FakeMonkeyOcr,
    make_transport: MakeTransport,
    reply: Reply,
    error: type[Exception],
    needle: str,
) -> None:
    fake_monkeyocr.script("a", reply)
    with pytest.raises(error) as caught:
        await make_transport("a").recognize_text(make_png())
    assert needle in str(caught.value)
    assert getattr(caught.value, "source_name", "monkey-a") == "monkey-a"


async def test_redirects_are_not_followed(
    fake_monkeyocr: FakeMonkeyOcr, make_transport: MakeTransport
) -> None:
    elsewhere = f"{fake_monkeyocr.base_url('b')}/ocr/text"
    fake_monkeyocr.script("a", Reply.with_status(307, b"", headers={"Location": elsewhere}))
    with pytest.raises(SourceDeadError, match="307"):
        await make_transport("a").recognize_text(make_png())
    assert fake_monkeyocr.uploads("b") == []


async def test_an_unloaded_model_is_transient(
    fake_monkeyocr: FakeMonkeyOcr, make_transport: MakeTransport
) -> None:
    fake_monkeyocr.configure("a", model_loaded=False)
    with pytest.raises(TransientError, match="Model not initialized"):
        await make_transport("a").recognize_text(make_png())


async def test_a_wrong_base_url_is_a_dead_source(
    fake_monkeyocr: FakeMonkeyOcr, make_transport: MakeTransport
) -> None:
    transport = make_transport("a/not-monkeyocr")
    with pytest.raises(SourceDeadError, match="404"):
        await transport.recognize_text(make_png())


@pytest.mark.parametrize(
    ("image", "needle"),
    [
        (b"", "empty"),
        (b"GIF89a\x01\x00\x01\x00", "PDF, PNG and JPEG"),
        (b"II*\x00 a tiff", "PDF, PNG and JPEG"),
    ],
    ids=["empty", "gif", "tiff"],
)
async def test_unusable_bytes_are_refused_before_anything_is_sent(
    fake_monkeyocr: FakeMonkeyOcr, make_transport: MakeTransport, image: bytes, needle: str
) -> None:
    with pytest.raises(RequestRejectedError, match=needle):
        await make_transport("a").recognize_text(image)
    assert fake_monkeyocr.uploads() == []


async def test_the_deadline_covers_the_whole_call(
    fake_monkeyocr: FakeMonkeyOcr, make_transport: MakeTransport
) -> None:
    fake_monkeyocr.script("a", Reply.ok(delay_s=5.0))
    transport = make_transport(
        "a", fields={"timeout_s": 0.3}, per_page_timeout_s=0, per_mb_timeout_s=0
    )
    with pytest.raises(TransientError) as caught:
        await transport.recognize_text(make_png())
    assert caught.value.reason == "timeout"
    assert "0.3s" in str(caught.value)


async def test_secrets_echoed_by_the_server_are_masked(
    fake_monkeyocr: FakeMonkeyOcr, make_transport: MakeTransport
) -> None:
    key, token = "sk-ocr-do-not-show-1234", "tok-proxy-credential-99"
    fake_monkeyocr.script("a", Reply.ocr_failed(f"auth failed for {key} with {token}"))
    transport = make_transport(
        "a", fields={"api_key": Secret(key)}, headers={"X-Proxy-Token": token}
    )
    with pytest.raises(TransientError) as caught:
        await transport.recognize_text(make_png())
    assert "auth failed" in str(caught.value)
    assert key not in str(caught.value) and token not in str(caught.value)
