"""Source options, the magic-number sniffer and the bbox rules (pure functions)."""

from __future__ import annotations

import math
import zlib

import pytest
from pgw_monkeyocr.middle import check_bbox
from pgw_monkeyocr.options import MIB, MonkeyOcrOptions
from pgw_monkeyocr.sniff import count_pdf_pages, describe_upload, sniff_kind
from pgw_monkeyocr.testing import make_jpeg, make_pdf, make_png
from pgw_monkeyocr.transport import MonkeyOcrTransport
from pgw_monkeyocr_test_helpers import monkey_source
from polygateway.errors import ConfigError


def test_defaults() -> None:
    options = MonkeyOcrOptions.from_mapping({}, source_name="s")
    assert options == MonkeyOcrOptions()
    assert options.trust_env is False and options.mode == "standard"
    assert options.max_zip_bytes == 256 * MIB


def test_strings_from_the_environment_are_accepted() -> None:
    options = MonkeyOcrOptions.from_mapping(
        {
            "trust_env": "YES",
            "mode": "Split",
            "per_page_timeout_s": "3.5",
            "max_zip_mb": "10",
            "max_member_mb": "0.5",
            "engine": "aiohttp",
            "headers": {"X-Team": "ocr"},
        },
        source_name="s",
    )
    assert options.trust_env is True and options.mode == "split"
    assert options.per_page_timeout_s == 3.5
    assert options.max_zip_bytes == 10 * MIB and options.max_member_bytes == MIB // 2
    assert options.headers == {"X-Team": "ocr"}


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"trust_env": "maybe"}, "'trust_env': must be true or false, got 'maybe'"),
        ({"mode": "fast"}, "'mode': must be one of standard, split"),
        ({"return_type": "zip_markdown"}, "must be one of zip_all, middle_json"),
        ({"mode": "split", "return_type": "middle_json"}, "split mode needs return_type"),
        ({"per_page_timeout_s": "-1"}, "must be a finite number >= 0"),
        ({"per_mb_timeout_s": "nan"}, "must be a finite number >= 0"),
        ({"max_zip_mb": "lots"}, "'max_zip_mb': must be a number"),
        ({"max_zip_mb": 0}, "caps must be > 0"),
        ({"health_timeout_s": 0}, "must be > 0"),
        ({"engine": "httpx"}, "aiohttp only"),
        ({"headers": "X-A: b"}, "'headers': must be a mapping"),
        ({"max_zip_bytes": 5}, "'max_zip_bytes': unknown option; allowed: "),
    ],
)
def test_bad_options_name_the_source_and_the_option(
    options: dict[str, object], needle: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        MonkeyOcrOptions.from_mapping(options, source_name="monkey-1")
    assert "source 'monkey-1': option" in str(caught.value)
    assert needle in str(caught.value)


@pytest.mark.parametrize("url", ["", "ftp://host/x", "monkey:7861", "http://"])
def test_a_base_url_that_is_not_http_is_a_config_error(url: str) -> None:
    with pytest.raises(ConfigError, match="base_url must be an http"):
        MonkeyOcrTransport(monkey_source(url))


def test_the_api_key_never_shows_in_the_source_repr() -> None:
    from polygateway.settings import Secret

    source = monkey_source("http://user:pw@10.0.0.5:7861", api_key=Secret("sk-secret-123456"))
    assert "sk-secret" not in repr(source) and "pw" not in repr(source)


@pytest.mark.parametrize(
    ("data", "kind"),
    [
        (make_png(), "png"),
        (make_jpeg(), "jpeg"),
        (make_pdf(), "pdf"),
        (b"\x00" * 500 + b"%PDF-1.7\n", "pdf"),
        (b"\x00" * 2000 + b"%PDF-1.7\n", None),
        (b"GIF89a", None),
        (b"RIFF\x00\x00\x00\x00WEBP", None),
        (b"", None),
    ],
    ids=["png", "jpeg", "pdf", "pdf-late-header", "pdf-header-too-late", "gif", "webp", "empty"],
)
def test_sniff_kind(data: bytes, kind: str | None) -> None:
    assert sniff_kind(data) == kind


def test_pdf_pages_are_counted_from_page_objects_or_the_page_tree() -> None:
    assert count_pdf_pages(make_pdf([(595, 842)] * 7)) == 7
    # Object streams hide the page objects: the page tree's /Count is the fallback.
    compressed = b"%PDF-1.7\n1 0 obj\n<< /Type /Pages /Count 12 /Kids [] >>\nendobj\n"
    compressed += zlib.compress(b"<< /Type /Page >>" * 12)
    assert count_pdf_pages(compressed) == 12
    assert count_pdf_pages(b"%PDF-1.7\nnothing to see") == 1
    upload = describe_upload(make_pdf([(1, 1)] * 3))
    assert (upload.kind, upload.filename, upload.pages) == ("pdf", "upload.pdf", 3)


@pytest.mark.parametrize(
    ("bbox", "expected"),
    [
        ([0, 0, 100, 100], ((0.0, 0.0, 100.0, 100.0), "")),
        ((10.5, 20, 30, 40.25), ((10.5, 20.0, 30.0, 40.25), "")),
        ([-1.9, -3.9, 101.9, 203.9], ((0.0, 0.0, 100.0, 200.0), "")),
        ([-2.1, 0, 10, 10], (None, "outside the 100x200 page")),
        ([0, 0, 10, 204.1], (None, "outside the 100x200 page")),
        ([101, 0, 102, 10], (None, "outside the 100x200 page")),
        ([10, 10, 10, 20], (None, "x0 >= x1")),
        ([10, 30, 20, 20], (None, "y0 >= y1")),
        ([0, 0, math.inf, 10], (None, "not finite")),
        ([0, True, 10, 10], (None, "not four numbers")),
        ("0 0 10 10", (None, "not four numbers")),
        (None, (None, "not four numbers")),
        ([0, 0, 10, 10, 5], (None, "not four numbers")),
    ],
)
def test_check_bbox(bbox: object, expected: tuple[object, str]) -> None:
    assert check_bbox(bbox, (100.0, 200.0), 0.02) == expected
