"""PolyGateway OCR over MonkeyOCR (entry point ``polygateway: monkeyocr``).

``MonkeyOcrTransport(source)`` implements ``OcrTextPort`` (``POST /ocr/text``) and
``OcrLayoutPort`` (``POST /parse`` -> ZIP -> ``*_middle.json``) for one MonkeyOCR server, with
``check_health()`` over ``GET /health``. ``pgw_monkeyocr.testing`` ships a faithful fake
MonkeyOCR server (also the pytest fixture ``fake_monkeyocr``).

Heavy modules are imported on first use, so loading the plugin costs nothing for an
application that does not use OCR.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pgw_monkeyocr.options import MonkeyOcrOptions
    from pgw_monkeyocr.transport import MonkeyOcrTransport

__all__ = ["MonkeyOcrOptions", "MonkeyOcrTransport"]


def __getattr__(name: str) -> Any:
    if name == "MonkeyOcrTransport":
        from pgw_monkeyocr.transport import MonkeyOcrTransport

        return MonkeyOcrTransport
    if name == "MonkeyOcrOptions":
        from pgw_monkeyocr.options import MonkeyOcrOptions

        return MonkeyOcrOptions
    raise AttributeError(f"module 'pgw_monkeyocr' has no attribute {name!r}")
