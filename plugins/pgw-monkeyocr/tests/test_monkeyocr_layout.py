"""``parse_layout`` over ``POST /parse`` -> ZIP -> ``*_middle.json`` against the fake server."""

from __future__ import annotations

import json
import math

import aiohttp
import pytest
from pgw_monkeyocr.classify import status_error
from pgw_monkeyocr.testing import (
    FakeMonkeyOcr,
    FakePage,
    Reply,
    equation_block,
    make_pdf,
    make_png,
    table_block,
    text_block,
)
from pgw_monkeyocr_test_helpers import MakeTransport
from polygateway.errors import (
    RequestRejectedError,
    ResultInvalidError,
    SourceDeadError,
    TransientError,
)
from polygateway.types import OcrElement

THREE_PAGES = [(595.0, 842.0), (842.0, 595.0), (612.0, 792.0)]


def _types(elements: tuple[OcrElement, ...], page: int = 0) -> list[str]:
    return [e.type for e in elements if e.page_idx == page]


async def test_layout_round_trip_of_an_image(
    fake_monkeyocr: FakeMonkeyOcr, make_transport: MakeTransport
) -> None:
    result = await make_transport("a").parse_layout(make_png(800, 600))
    assert result.page_size == (800.0, 600.0)
    assert result.page_sizes == ((800.0, 600.0),)
    assert _types(result.elements) == [
        "title",
        "text",
        "interline_equation",
        "table",
        "table_caption",
        "image",
        "image_caption",
    ]
    title, text, equation, table, caption, image, figure_caption = result.elements
    assert title.text == "Fake document, page 1"
    assert title.bbox == (80.0, 30.0, 720.0, 60.0)
    assert text.text == "Hello from the fake MonkeyOCR.\nEnergy is $E=mc^2$"
    assert equation.latex == r"\int_0^1 x\,dx = \frac{1}{2}" and equation.text == ""
    assert table.html == "<table><tr><td>1</td><td>2</td></tr></table>"
    assert table.bbox == (80.0, 240.0, 720.0, 390.0)
    assert caption.text == "Table 1: fake figures"
    assert image.html is None and figure_caption.text == "Figure 1: a fake picture"
    assert result.bbox_issues == ()
    assert result.source_name == "monkey-a"
    assert result.usage.elapsed_ms >= 0 and result.usage.prompt_tokens == 0
    raw = result.raw
    assert raw["response"]["download_url"].startswith("/static/upload_parsed_")
    assert raw["response"]["files"][0].endswith(".md")
    assert "upload_middle.json" in raw["entries"] and "upload_content_list.json" in raw["entries"]
    assert any(name.startswith("images/") for name in raw["entries"])
    assert raw["middle"]["_version_name"] == "1.1.0"
    assert raw["markdown"].startswith("# Fake document, page 1")
    assert raw["zip_bytes"] > 0
    (upload,) = fake_monkeyocr.uploads("a")
    assert (upload.path, upload.filename) == ("/parse", "upload.png")
    assert fake_monkeyocr.downloads("a") == [raw["response"]["download_url"][len("/static/") :]]


async def test_a_three_page_pdf_has_its_own_size_per_page(make_transport: MakeTransport) -> None:
    result = await make_transport("a").parse_layout(make_pdf(THREE_PAGES))
    assert result.page_sizes == tuple(THREE_PAGES)
    assert {e.page_idx for e in result.elements} == {0, 1, 2}
    for page, (width, height) in enumerate(THREE_PAGES):
        titles = [e for e in result.elements if e.page_idx == page and e.type == "title"]
        assert [t.text for t in titles] == [f"Fake document, page {page + 1}"]
        for element in (e for e in result.elements if e.page_idx == page):
            x0, y0, x1, y1 = element.bbox
            assert 0 <= x0 < x1 <= width and 0 <= y0 < y1 <= height


async def test_split_mode_parses_one_middle_json_per_page_directory(
    fake_monkeyocr: FakeMonkeyOcr, make_transport: MakeTransport
) -> None:
    result = await make_transport("a", mode="split").parse_layout(make_pdf(THREE_PAGES))
    (upload,) = fake_monkeyocr.uploads("a")
    assert upload.path == "/parse/split"
    assert result.raw["response"]["download_url"].startswith("/static/upload_split_")
    middles = [n for n in result.raw["entries"] if n.endswith("_middle.json")]
    assert [n.split("/")[0] for n in middles] == ["page_0", "page_1", "page_2"]
    assert all(n.startswith(f"page_{i}/upload_upload_") for i, n in enumerate(middles))
    # Every split file says page_idx 0; the directory decides the page.
    assert [doc["pdf_info"][0]["page_idx"] for doc in result.raw["middle"]] == [0, 0, 0]
    assert result.page_sizes == tuple(THREE_PAGES)
    for page in range(3):
        titles = [e.text for e in result.elements if e.page_idx == page and e.type == "title"]
        assert titles == [f"Fake document, page {page + 1}"]
    assert result.raw["markdown"].count("# Fake document") == 3


async def test_inline_middle_json_skips_the_download_on_servers_that_know_return_type(
    fake_monkeyocr: FakeMonkeyOcr, make_transport: MakeTransport
) -> None:
    result = await make_transport("a", return_type="middle_json").parse_layout(make_png(800, 600))
    (upload,) = fake_monkeyocr.uploads("a")
    assert upload.query == {"return_type": "middle_json"}
    assert fake_monkeyocr.downloads("a") == []
    assert result.raw["response"]["content_type"] == "application/json"
    assert result.page_sizes == ((800.0, 600.0),) and len(result.elements) == 7


async def test_the_older_server_variant_without_return_type_answers_a_zip(
    fake_monkeyocr: FakeMonkeyOcr, make_transport: MakeTransport
) -> None:
    fake_monkeyocr.configure("a", variant="dashboard")
    result = await make_transport("a", return_type="middle_json").parse_layout(make_png(800, 600))
    assert "content" not in result.raw["response"]
    assert len(fake_monkeyocr.downloads("a")) == 1
    assert len(result.elements) == 7


@pytest.mark.parametrize(
    ("reply", "needle"),
    [
        (Reply.inline("No middle.json file found"), "No middle.json file found"),
        (Reply.inline("Unknown return_type: middle_jsn"), "Unknown return_type"),
        (Reply.inline("{not json", "application/json"), "not valid JSON"),
        (Reply.zip("no_middle"), "no *_middle.json"),
        (Reply.zip("corrupt"), "ZIP"),
        (Reply.zip("bad_json"), "not valid JSON"),
        (Reply.zip(pages=[FakePage(size=None)]), "page_size"),
        (Reply.zip(pages=[FakePage(size=[0, 842])]), "page_size"),
        (
            Reply.with_status(200, {"success": True, "message": "ok", "download_url": None}),
            "neither download_url nor content",
        ),
        (
            Reply.with_status(
                200, {"success": True, "message": "ok", "download_url": "http://elsewhere/x.zip"}
            ),
            "points away",
        ),
        (Reply.with_status(200, "<html>not json</html>"), "not a JSON object"),
    ],
    ids=[
        "text-plain-no-file",
        "text-plain-unknown-return-type",
        "inline-bad-json",
        "zip-without-middle",
        "corrupt-zip",
        "unparsable-middle",
        "no-page-size",
        "zero-page-size",
        "no-download-url",
        "foreign-download-url",
        "answer-not-json",
    ],
)
async def test_unusable_results_are_result_invalid(
    fake_monkeyocr: FakeMonkeyOcr, make_transport: MakeTransport, reply: Reply, needle: str
) -> None:
    fake_monkeyocr.script("a", reply)
    with pytest.raises(ResultInvalidError) as caught:
        await make_transport("a").parse_layout(make_png())
    assert needle in str(caught.value)


@pytest.mark.parametrize(
    ("reply", "error", "needle"),
    [
        (Reply.parse_failed("name 'os' is not defined"), TransientError, "Parsing failed"),
        (Reply.parse_failed("CUDA out of memory"), TransientError, "CUDA"),
        (
            Reply.with_status(
                500,
                {"detail": "Parsing failed: 400: Unsupported file type: .gif. Allowed: .png, .pdf"},
            ),
            RequestRejectedError,
            "Unsupported file type",
        ),
        (
            Reply.with_status(
                422, {"detail": [{"loc": ["body", "file"], "msg": "Field required"}]}
            ),
            RequestRejectedError,
            "422",
        ),
        (Reply.with_status(504, "Gateway Time-out"), TransientError, "504"),
        (Reply.with_status(403, {"detail": "Forbidden"}), SourceDeadError, "403"),
        (Reply.reset(), TransientError, "network error"),
        (Reply.zip(download="gone"), TransientError, "no longer on the server"),
    ],
    ids=["server-bug", "cuda-oom", "unsupported-type", "422", "504", "403", "reset", "zip-gone"],
)
async def test_parse_failures_map_to_the_error_classes(
    fake_monkeyocr: FakeMonkeyOcr,
    make_transport: MakeTransport,
    reply: Reply,
    error: type[Exception],
    needle: str,
) -> None:
    fake_monkeyocr.script("a", reply)
    with pytest.raises(error) as caught:
        await make_transport("a").parse_layout(make_png())
    assert type(caught.value) is error
    assert needle in str(caught.value)


async def test_a_real_unsupported_upload_is_a_rejected_request(
    fake_monkeyocr: FakeMonkeyOcr, make_transport: MakeTransport
) -> None:
    """The server's own answer to a bad extension (what an older client would have caused)."""
    async with aiohttp.ClientSession() as session:
        form = aiohttp.FormData()
        form.add_field("file", b"hello", filename="notes.txt")
        async with session.post(f"{fake_monkeyocr.base_url('a')}/parse", data=form) as response:
            assert response.status == 500
            detail = (await response.json())["detail"]
    assert detail.startswith("Parsing failed: 400: Unsupported file type: .txt. Allowed: ")
    error = status_error(
        500, json.dumps({"detail": detail}).encode(), {}, endpoint="/parse", source_name="s",
        secret=None,
    )  # fmt: skip
    assert isinstance(error, RequestRejectedError)


async def test_unsafe_zip_entries_are_never_read(
    fake_monkeyocr: FakeMonkeyOcr, make_transport: MakeTransport
) -> None:
    fake_monkeyocr.script("a", Reply.zip("traversal"))
    result = await make_transport("a").parse_layout(make_png(800, 600))
    assert sorted(result.raw["skipped_entries"]) == [
        "../../outside_middle.json",
        "/etc/absolute_middle.json",
    ]
    assert result.page_sizes == ((800.0, 600.0),) and len(result.elements) == 7


async def test_a_decompression_bomb_is_bounded(
    fake_monkeyocr: FakeMonkeyOcr, make_transport: MakeTransport
) -> None:
    fake_monkeyocr.script("a", Reply.zip(middle_padding=3 * 1024 * 1024))
    with pytest.raises(ResultInvalidError, match="cap"):
        await make_transport("a", max_member_mb=1).parse_layout(make_png())


@pytest.mark.parametrize("how", ["real-size", "announced"])
async def test_a_zip_over_the_cap_is_refused_naming_it(
    fake_monkeyocr: FakeMonkeyOcr, make_transport: MakeTransport, how: str
) -> None:
    if how == "real-size":
        fake_monkeyocr.script("a", Reply.zip(padding=3 * 1024 * 1024))
    else:
        fake_monkeyocr.script("a", Reply.zip(download="announce_huge"))
    with pytest.raises(TransientError) as caught:
        await make_transport("a", max_zip_mb=2).parse_layout(make_png())
    assert "2097152-byte cap" in str(caught.value) and "max_zip_mb=2" in str(caught.value)
    await fake_monkeyocr.wait_until_async(lambda f: f.open_connections == 0)


async def test_bad_bboxes_are_reported_and_the_rest_kept(
    fake_monkeyocr: FakeMonkeyOcr, make_transport: MakeTransport
) -> None:
    blocks = [
        text_block([10, 10, 200, 40], "good"),
        text_block([-5, -5, 200, 40], "slightly outside: clamped"),
        text_block([50, 50, 20, 80], "inverted x"),
        text_block([50, 80, 90, 80], "flat"),
        text_block([10, 10, 2000, 40], "far outside"),
        text_block([10, 10, 20], "three numbers"),
        text_block(["a", 1, 2, 3], "a string"),
        equation_block([math.nan, 1, 2, 3], "x"),
        table_block([10, 100, 500, 300], html="<table></table>", body_bbox=[10, 100, 500, 300]),
    ]
    fake_monkeyocr.script("a", Reply.zip(pages=[FakePage((600, 800), blocks)]))
    result = await make_transport("a").parse_layout(make_png())
    assert [(e.text, e.bbox) for e in result.elements if e.type == "text"] == [
        ("good", (10.0, 10.0, 200.0, 40.0)),
        ("slightly outside: clamped", (0.0, 0.0, 200.0, 40.0)),
    ]
    assert [e.type for e in result.elements][-1] == "table"
    reasons = {(i.text, i.reason) for i in result.bbox_issues}
    assert reasons == {
        ("inverted x", "x0 >= x1"),
        ("flat", "y0 >= y1"),
        ("far outside", "outside the 600x800 page"),
        ("three numbers", "not four numbers"),
        ("a string", "not four numbers"),
        ("", "not finite"),
    }
    assert all(i.page_idx == 0 for i in result.bbox_issues)
    assert next(i for i in result.bbox_issues if i.text == "flat").bbox == "[50, 80, 90, 80]"


async def test_an_empty_page_is_an_empty_result(
    fake_monkeyocr: FakeMonkeyOcr, make_transport: MakeTransport
) -> None:
    fake_monkeyocr.script("a", Reply.zip(pages=[FakePage((600, 800), [])]))
    result = await make_transport("a").parse_layout(make_png())
    assert result.elements == () and result.bbox_issues == ()
    assert result.page_sizes == ((600.0, 800.0),)


async def test_an_unloaded_model_is_transient(
    fake_monkeyocr: FakeMonkeyOcr, make_transport: MakeTransport
) -> None:
    fake_monkeyocr.configure("a", model_loaded=False)
    with pytest.raises(TransientError, match="Model not initialized"):
        await make_transport("a").parse_layout(make_png())
