"""``pgw fake-upstream --port N``: the fake OpenAI-compatible upstream in the foreground.

For benchmarks and soak runs: prints its base URL, serves until SIGINT/SIGTERM. ``--chunks``,
``--content-bytes`` and ``--inter-token-delay`` set the default reply of every source;
``--embedding-dim`` the size of its ``/v1/embeddings`` vectors. ``--sources FILE`` gives
sources their own behaviour (a fault mix, see ``polygateway.testing.fake_upstream.faultmix``);
``--arrivals-log PATH`` writes one JSON line per request. ``GET /_fake/counters`` answers the
counters (requests, in flight, max in flight per source and route).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from polygateway.testing.fake_upstream.faultmix import ArrivalLog


def configure(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    parser.description = "Serve a fake OpenAI-compatible upstream (testing and benchmarks)."
    parser.add_argument("--port", type=int, required=True, help="TCP port (0: any free port)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--chunks", type=_positive_int, help="content chunks per streamed reply")
    parser.add_argument(
        "--content-bytes", type=_positive_int, help="size of the reply content in characters"
    )
    parser.add_argument(
        "--inter-token-delay",
        type=_non_negative_float,
        default=0.0,
        help="seconds between streamed chunks (default 0)",
    )
    parser.add_argument(
        "--embedding-dim",
        type=_positive_int,
        help="vector size of /v1/embeddings (default: the fake upstream's own)",
    )
    parser.add_argument(
        "--sources",
        metavar="FILE",
        help="JSON file: per source, its reply or a weighted mix of replies (a fault mix)",
    )
    parser.add_argument(
        "--arrivals-log",
        metavar="PATH",
        help="append one JSON line per request (time, source, route, tag, reply, usage)",
    )
    parser.add_argument(
        "--tag-pattern",
        help="regex whose first group, found in a request's text, is logged as its tag "
        r"(default \[tag:...\])",
    )
    return run


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0.0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _content(size: int) -> str:
    words = "lorem ipsum dolor sit amet consectetur adipiscing elit "
    return (words * (size // len(words) + 1))[:size]


def run(args: argparse.Namespace) -> int:
    import asyncio
    import json
    from contextlib import ExitStack

    sources = None
    if args.sources:
        with open(args.sources, encoding="utf-8") as f:
            sources = json.load(f)
    with ExitStack() as files:
        log = None
        if args.arrivals_log:
            from polygateway.testing.fake_upstream.faultmix import DEFAULT_TAG_PATTERN, ArrivalLog

            out = files.enter_context(open(args.arrivals_log, "a", encoding="utf-8"))
            log = ArrivalLog(out, args.tag_pattern or DEFAULT_TAG_PATTERN)
        return asyncio.run(_serve(args, sources, log))


async def _serve(args: argparse.Namespace, sources: Any, log: ArrivalLog | None) -> int:
    import asyncio
    import contextlib
    import signal

    from polygateway.testing.fake_upstream import DEFAULT_CONTENT, FakeUpstream, Reply
    from polygateway.testing.fake_upstream.embeddings import DEFAULT_EMBEDDING_DIM
    from polygateway.testing.fake_upstream.faultmix import apply_sources

    content = _content(args.content_bytes) if args.content_bytes else DEFAULT_CONTENT
    default_reply = Reply.ok(content, chunks=args.chunks, inter_token_delay=args.inter_token_delay)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    # Benchmarks run for long: do not keep every request body.
    async with FakeUpstream(
        host=args.host,
        port=args.port,
        default_reply=default_reply,
        embedding_dim=args.embedding_dim or DEFAULT_EMBEDDING_DIM,
        keep_received=False,
        on_arrival=log,
    ) as fake:
        if sources is not None:
            apply_sources(fake, sources)
        print(fake.base_url(), flush=True)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await stop.wait()
            if log is not None:
                log.flush()
    return 0
