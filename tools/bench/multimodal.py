"""What a large image part costs the full pipeline beyond the governed call, against the floor
of hashing the image's bytes once, in one run.

    python tools/bench/multimodal.py [--mb 5] [--calls 20] [--rounds 5] [--modes json,stream]
    python tools/bench/multimodal.py --callgrind [--calls-pair 3,9] [--modes json]

Starts ``pgw fake-upstream`` (its own process). Every call sends one user message: a short text
part that changes per call (every call a cache miss) and one ``image_url`` part holding a
``--mb`` megabyte base64 data URL, the same string on every call. Rows, interleaved over
``--rounds`` rounds (the order rotates), CPU time of this process per call, median of rounds:

- ``governed``: ``GatewayClient.from_env``, telemetry and cache off;
- ``full``: the full pipeline, SQLite telemetry and the memory cache;
- ``floor``: ``hashlib.sha256`` of the data URL's UTF-8 bytes (built once, outside the timing):
  the least any digest of the part can cost;
- ``plain-form`` / ``part_sha256``: the sha256 of the part's canonical JSON (the digest's form
  before version 2) and ``polygateway.digest.part_sha256`` (what the pipeline computes).

The verdict is ``(full - governed) / floor`` of each round (paired), its median: the extra CPU
the full pipeline spends on a call carrying the image, in units of one hash of its bytes
(budget 1.3x). Every ``full`` round also checks that each call wrote its telemetry row.

``--callgrind``: each of ``governed``, ``full`` and ``floor`` in a child process under
``valgrind --tool=callgrind`` twice, with the two call counts of ``--calls-pair``; instructions
per call are the difference of the totals over the difference of the counts (start-up and
warm-up cancel out). Instruction counts do not move with the machine's load.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import gc
import hashlib
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from overhead import free_port, governed_env, start_upstream

WARMUP_CALLS = 3
ROWS = ("governed", "full", "floor", "plain-form", "part_sha256")
CALLGRIND_ROWS = ("floor", "governed", "full")


def data_url(megabytes: float) -> str:
    """A base64 data URL about ``megabytes`` long (random bytes: nothing compresses it)."""
    raw = os.urandom(int(megabytes * 1_000_000 * 3 / 4))
    return "data:image/png;base64," + base64.b64encode(raw).decode("ascii")


def image_messages(url: str, n: int) -> list[dict[str, Any]]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": f"Describe image #{n}"},
                {"type": "image_url", "image_url": {"url": url, "detail": "high"}},
            ],
        }
    ]


def make_client(upstream: str, db: str, *, full: bool) -> Any:
    from polygateway import GatewayClient
    from polygateway.transports.engines import DEFAULT_ENGINE

    env = governed_env(
        upstream,
        DEFAULT_ENGINE,
        telemetry="sqlite" if full else "none",
        cache="memory" if full else "none",
        db=db,
    )
    return GatewayClient.from_env(env=env)


class ChatRow:
    """One client making image calls, numbered across rounds (every call a cache miss)."""

    def __init__(self, upstream: str, image: str, db: str, *, full: bool, stream: bool) -> None:
        self.client = make_client(upstream, db, full=full)
        self.image = image
        self.db = db
        self.full = full
        self.stream = stream
        self.made = 0

    async def calls(self, count: int) -> None:
        for _ in range(count):
            messages = image_messages(self.image, self.made)
            self.made += 1
            await self.client.chat(messages, stream=self.stream)

    def rows_written(self) -> int:
        with closing(sqlite3.connect(self.db)) as conn:
            return int(conn.execute("SELECT COUNT(*) FROM pgw_calls").fetchone()[0])


def digest_rows(image: str) -> dict[str, Callable[[], object]]:
    from polygateway.digest import canonical_json_bytes, part_sha256

    part = image_messages(image, 0)[0]["content"][1]
    image_bytes = image.encode("utf-8")
    return {
        "floor": lambda: hashlib.sha256(image_bytes).hexdigest(),
        "plain-form": lambda: hashlib.sha256(canonical_json_bytes(part)).hexdigest(),
        "part_sha256": lambda: part_sha256(part),
    }


def cpu_ms_per_call(run: Callable[[], object], calls: int) -> float:
    gc.collect()
    start = time.process_time()
    for _ in range(calls):
        run()
    return (time.process_time() - start) / calls * 1000


async def measure(args: argparse.Namespace, stream: bool) -> None:
    image = data_url(args.mb)
    port = free_port()
    upstream = start_upstream(port, args.chunks)
    url = f"http://127.0.0.1:{port}/v1"
    samples: dict[str, list[float]] = {name: [] for name in ROWS}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            chats = {
                "governed": ChatRow(url, image, "", full=False, stream=stream),
                "full": ChatRow(url, image, os.path.join(tmp, "t.db"), full=True, stream=stream),
            }
            try:
                for chat in chats.values():
                    await chat.calls(WARMUP_CALLS)
                hashes = digest_rows(image)
                for round_ in range(args.rounds):
                    order = ROWS[round_ % len(ROWS) :] + ROWS[: round_ % len(ROWS)]
                    for name in order:
                        if name in chats:
                            gc.collect()
                            start = time.process_time()
                            await chats[name].calls(args.calls)
                            spent = time.process_time() - start
                            samples[name].append(spent / args.calls * 1000)
                        else:
                            samples[name].append(cpu_ms_per_call(hashes[name], args.calls))
                full = chats["full"]
                await full.client.aclose()
                rows = full.rows_written()
                lost = "" if rows == full.made else " LOST"
                print(f"telemetry rows {rows}/{full.made}{lost}")
            finally:
                for chat in chats.values():
                    await chat.client.aclose()
    finally:
        upstream.terminate()
        upstream.wait(10)
    mode = "stream" if stream else "json"
    print(
        f"\n{mode}: {len(image) / 1e6:.2f} MB data URL, {args.calls} calls x {args.rounds} rounds"
    )
    print("| row | CPU ms/call (median) | rounds |")
    print("|---|---:|---|")
    for name in ROWS:
        values = samples[name]
        spread = " ".join(f"{v:.2f}" for v in values)
        print(f"| {name} | {statistics.median(values):.3f} | {spread} |")
    paired = [
        (full - governed) / floor
        for full, governed, floor in zip(
            samples["full"], samples["governed"], samples["floor"], strict=True
        )
    ]
    verdict = statistics.median(paired)
    print(
        f"(full - governed) / floor: median {verdict:.2f}x "
        f"(rounds {' '.join(f'{r:.2f}' for r in paired)}); "
        f"{'within' if verdict <= 1.3 else 'OVER'} the 1.3x budget"
    )
    print(f"load average {os.getloadavg()}")


async def child(args: argparse.Namespace) -> None:
    """The measured process of ``--callgrind``: warm-up, then ``--child-calls`` calls."""
    image = data_url(args.mb)
    name, calls = args.child, args.child_calls
    if name == "floor":
        image_bytes = image.encode("utf-8")
        for _ in range(WARMUP_CALLS + calls):
            hashlib.sha256(image_bytes).hexdigest()
        return
    with tempfile.TemporaryDirectory() as tmp:
        chat = ChatRow(
            args.url,
            image,
            os.path.join(tmp, "t.db"),
            full=name == "full",
            stream=args.modes == "stream",
        )
        try:
            await chat.calls(WARMUP_CALLS)
            gc.collect()
            gc.freeze()
            await chat.calls(calls)
        finally:
            await chat.client.aclose()


def callgrind_total(*child_args: str) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        done = subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={out}",
                sys.executable,
                __file__,
                *child_args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"callgrind run failed: {done.stderr[-2000:]}")
        for line in Path(out).read_text().splitlines():
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1])
    raise RuntimeError("no totals in the callgrind output")


def run_callgrind(args: argparse.Namespace) -> None:
    low, high = (int(n) for n in args.calls_pair.split(","))
    port = free_port()
    upstream = start_upstream(port, args.chunks)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        for mode in args.modes.split(","):
            per_call: dict[str, float] = {}
            for name in CALLGRIND_ROWS:
                common = ["--child", name, "--url", url, "--modes", mode, "--mb", str(args.mb)]
                small = callgrind_total(*common, "--child-calls", str(low))
                large = callgrind_total(*common, "--child-calls", str(high))
                per_call[name] = (large - small) / (high - low)
                print(f"{mode:6} {name:9} {per_call[name] / 1e6:9.2f} M instructions/call")
            extra = per_call["full"] - per_call["governed"]
            print(
                f"{mode:6} (full - governed) / floor: {extra / per_call['floor']:.2f}x "
                f"({extra / 1e6:.2f} M / {per_call['floor'] / 1e6:.2f} M)"
            )
    finally:
        upstream.terminate()
        upstream.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--mb", type=float, default=5.0, help="size of the data URL, MB")
    parser.add_argument("--calls", type=int, default=20, help="calls per row per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chunks", type=int, default=20)
    parser.add_argument("--modes", default="json,stream")
    parser.add_argument("--callgrind", action="store_true")
    parser.add_argument("--calls-pair", default="3,9", help="--callgrind call counts")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    parser.add_argument("--child-calls", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--url", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        asyncio.run(child(args))
    elif args.callgrind:
        run_callgrind(args)
    else:
        print(f"nproc {os.cpu_count()}, load average {os.getloadavg()}", flush=True)
        for mode in args.modes.split(","):
            asyncio.run(measure(args, mode == "stream"))


if __name__ == "__main__":
    main()
