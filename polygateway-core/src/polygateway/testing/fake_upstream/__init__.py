"""A real HTTP/1.1 server on loopback that speaks the OpenAI-compatible protocol and the
Anthropic Messages API (``POST /v1/messages``, route ``messages``) byte for byte.

Tests (and benchmarks) point a client at it and script what each logical source answers:
normal completions, any error status, delays that trip each watchdog layer, streams cut before
``[DONE]``, malformed frames, resets and black holes. It counts what really reached the wire.

It is written directly on ``asyncio.Protocol`` with a minimal HTTP/1.1 parser so that it is never
the bottleneck of a benchmark and so that faults are exact at the byte level. A response is
planned as a list of steps (bytes to write, delays, terminal actions); a plan made of bytes only
is written synchronously from ``data_received`` without creating a task.

    async with FakeUpstream() as fake:
        fake.script("a", Reply.error(429, retry_after=2), Reply.ok(content="hi"))
        url = fake.base_url("a")          # http://127.0.0.1:PORT/a/v1

    with FakeUpstream.in_thread() as fake:  # own loop in a daemon thread
        ...

The package has one module per concern, so that a new protocol is one more module of answers:
``replies`` (:class:`Reply`, :class:`ReceivedRequest`), ``wire`` (HTTP framing, plan steps),
``connection`` (the HTTP/1.1 server protocol), ``openai`` (the OpenAI routes' answers),
``anthropic`` (the Messages route's answers), ``embeddings`` (the vectors of the embeddings
answers) and ``server`` (:class:`FakeUpstream`: lifecycle, scripting, counters, routing).
"""

from __future__ import annotations

from polygateway.testing.fake_upstream.replies import (
    DEFAULT_CONTENT,
    ReceivedRequest,
    Reply,
    estimate_tokens,
)
from polygateway.testing.fake_upstream.server import Arrival, FakeUpstream

__all__ = [
    "DEFAULT_CONTENT",
    "Arrival",
    "FakeUpstream",
    "ReceivedRequest",
    "Reply",
    "estimate_tokens",
]
