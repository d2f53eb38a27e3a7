"""PolyGateway OCR over MonkeyOCR (entry point ``polygateway: monkeyocr``).

``MonkeyOcrTransport(source)`` implements ``OcrTextPort`` (``POST /ocr/text``) and
``OcrLayoutPort`` (``POST /parse`` -> ZIP -> ``*_middle.json``) for one MonkeyOCR server, with
``check_health()`` over ``GET /health``; it is registered as the OCR transport ``monkeyocr``.
``OcrClient`` runs those calls governed (``polygateway.governance.Governor``) over the sources
of a scope (``OcrClient.from_env(scope="OCR")``). ``pgw_monkeyocr.testing`` ships a faithful fake
MonkeyOCR server (also the pytest fixture ``fake_monkeyocr``).

Heavy modules are imported on first use, so loading the plugin costs nothing for an
application that does not use OCR.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from polygateway.hookspecs import hookimpl
from polygateway.ports import Register

if TYPE_CHECKING:
    from polygateway.settings import SourceConfig

    from pgw_monkeyocr.client import OcrClient
    from pgw_monkeyocr.options import MonkeyOcrOptions
    from pgw_monkeyocr.transport import MonkeyOcrTransport

__all__ = ["MonkeyOcrOptions", "MonkeyOcrTransport", "OcrClient"]


@hookimpl
def pgw_register_ocr_transports(register: Register) -> None:
    def monkeyocr(source: SourceConfig) -> MonkeyOcrTransport:
        from pgw_monkeyocr.transport import MonkeyOcrTransport

        return MonkeyOcrTransport(source)

    register("monkeyocr", monkeyocr)


def __getattr__(name: str) -> Any:
    if name == "OcrClient":
        from pgw_monkeyocr.client import OcrClient

        return OcrClient
    if name == "MonkeyOcrTransport":
        from pgw_monkeyocr.transport import MonkeyOcrTransport

        return MonkeyOcrTransport
    if name == "MonkeyOcrOptions":
        from pgw_monkeyocr.options import MonkeyOcrOptions

        return MonkeyOcrOptions
    raise AttributeError(f"module 'pgw_monkeyocr' has no attribute {name!r}")
