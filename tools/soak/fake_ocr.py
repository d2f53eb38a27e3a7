"""The fake MonkeyOCR server of a soak run, in its own process.

    python tools/soak/fake_ocr.py --port N --counters PATH

Serves the fleet's OCR sources (``fleet.OCR_SOURCES``) until SIGTERM/SIGINT, then writes its
counters as JSON to PATH: uploads and max in flight per source.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal

from fleet import OCR_SOURCES
from pgw_monkeyocr.testing import FakeMonkeyOcr


async def serve(port: int) -> dict[str, dict[str, int]]:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    async with FakeMonkeyOcr(port=port) as fake:
        for source in OCR_SOURCES:
            fake.configure(source.fake, serial=bool(source.behaviour.get("serial")))
        print(f"http://127.0.0.1:{fake.port}", flush=True)
        await stop.wait()
        out = {
            s.fake: {
                "uploads": len(fake.uploads(s.fake)),
                "max_inflight": fake.max_inflight(s.fake),
            }
            for s in OCR_SOURCES
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--counters", required=True)
    args = parser.parse_args()
    counters = asyncio.run(serve(args.port))
    with open(args.counters, "w", encoding="utf-8") as f:
        json.dump(counters, f)


if __name__ == "__main__":
    main()
