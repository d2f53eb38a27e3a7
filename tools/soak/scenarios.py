"""The soak scenarios P1-P6: each is an endless, seeded generator of :class:`CallSpec`.

- P1 short chat: one short user prompt, streamed, unique per call (cache misses); or, with
  ``--replay DB``, a prompt of an earlier run's telemetry (its tag keeps it unique).
- P2 long streaming with reasoning: a long system + user prompt, streamed; every other call
  through ``client.stream`` (deltas to the caller), the rest through ``chat()``.
- P3 structured output: ``structured=<pydantic model>``; 3 in 10 calls (the P4 share) repeat
  one of a small pool of prompts, alternating two tenants (cache namespaces), so the cache is
  exercised both ways: hits within a tenant, never across tenants.
- P4 the repeated share alone.
- P5 embeddings: 1-40 texts per call (several batches).
- P6 the mix: P1 10% / P2 20% / P3 50% (P4 inside) / P5 20%, plus an OCR share (every
  ``OCR_EVERY``-th call is an OCR call against the fake MonkeyOCR; 0 turns it off).

Tags are ``<worker>-<n>`` (unique per call) or ``<worker>-r<k>`` (a repeated prompt), so every
request the upstream logs is attributable to one worker.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from corpus import Message, synthetic_prompt, synthetic_texts, tagged, with_tag

Kind = Literal["chat", "stream", "embed", "ocr"]
SCENARIOS = ("P1", "P2", "P3", "P4", "P5", "P6")
P6_WEIGHTS: tuple[tuple[str, int], ...] = (("P1", 10), ("P2", 20), ("P3", 50), ("P5", 20))
REPEAT_SHARE = 0.3
REPEAT_POOL = 12
TENANTS = ("A", "B")
OCR_EVERY = 20


@dataclass(frozen=True)
class CallSpec:
    scenario: str
    kind: Kind
    tag: str
    messages: tuple[Message, ...] = ()
    texts: tuple[str, ...] = ()
    structured: bool = False
    repeat: bool = False
    tenant: str = "A"
    max_tokens: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _p1(
    worker: str, n: int, rng: random.Random, replay: list[list[Message]] | None = None
) -> CallSpec:
    tag = f"{worker}-{n}"
    if replay:
        messages = with_tag(replay[rng.randrange(len(replay))], tag)
        return CallSpec("P1", "chat", tag, tuple(messages), max_tokens=64)
    prompt = tagged(tag, synthetic_prompt(rng.randrange(1 << 30), rng.randint(6, 20)))
    return CallSpec("P1", "chat", tag, ({"role": "user", "content": prompt},), max_tokens=64)


def _p2(worker: str, n: int, rng: random.Random) -> CallSpec:
    tag = f"{worker}-{n}"
    system = synthetic_prompt(rng.randrange(1 << 30), rng.randint(150, 400))
    user = tagged(tag, synthetic_prompt(rng.randrange(1 << 30), rng.randint(40, 120)))
    messages = ({"role": "system", "content": system}, {"role": "user", "content": user})
    kind: Kind = "stream" if n % 2 else "chat"
    return CallSpec("P2", kind, tag, messages, max_tokens=512)


def _p3(worker: str, n: int, rng: random.Random, *, repeat: bool | None = None) -> CallSpec:
    if repeat is None:
        repeat = rng.random() < REPEAT_SHARE
    if repeat:
        k = rng.randrange(REPEAT_POOL)
        tag = f"{worker}-r{k}"
        prompt = tagged(tag, "Extract the invoice number and total: " + synthetic_prompt(k, 24))
        tenant = TENANTS[n % len(TENANTS)]
        return CallSpec(
            "P4",
            "chat",
            tag,
            ({"role": "user", "content": prompt},),
            structured=True,
            repeat=True,
            tenant=tenant,
        )
    tag = f"{worker}-{n}"
    prompt = tagged(
        tag,
        "Extract the invoice number and total: "
        + synthetic_prompt(rng.randrange(1 << 30), rng.randint(20, 60)),
    )
    return CallSpec("P3", "chat", tag, ({"role": "user", "content": prompt},), structured=True)


def _p5(worker: str, n: int, rng: random.Random) -> CallSpec:
    tag = f"{worker}-{n}"
    texts = tuple(
        tagged(tag, text) for text in synthetic_texts(rng.randrange(1 << 30), rng.randint(1, 40))
    )
    return CallSpec("P5", "embed", tag, texts=texts)


def _ocr(worker: str, n: int) -> CallSpec:
    return CallSpec("OCR", "ocr", f"{worker}-{n}")


def calls(
    scenario: str,
    worker: str,
    seed: int,
    *,
    ocr_every: int = OCR_EVERY,
    replay: list[list[Message]] | None = None,
) -> Iterator[CallSpec]:
    """The endless call sequence of ``scenario`` for ``worker`` (reproducible by ``seed``);
    ``replay``: the prompts of P1 calls come from these (an earlier run's, see
    ``corpus.replay_messages``) instead of the synthetic corpus."""
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r} (one of {', '.join(SCENARIOS)})")
    if ocr_every < 0:
        raise ValueError(f"ocr_every must be >= 0, got {ocr_every}")
    rng = random.Random(f"{seed}:{worker}:{scenario}")
    names = [name for name, _ in P6_WEIGHTS]
    weights = [weight for _, weight in P6_WEIGHTS]
    n = 0
    while True:
        n += 1
        if scenario == "P6" and ocr_every and n % ocr_every == 0:
            yield _ocr(worker, n)
            continue
        pick = scenario if scenario != "P6" else rng.choices(names, weights)[0]
        if pick == "P1":
            yield _p1(worker, n, rng, replay)
        elif pick == "P2":
            yield _p2(worker, n, rng)
        elif pick == "P3":
            yield _p3(worker, n, rng)
        elif pick == "P4":
            yield _p3(worker, n, rng, repeat=True)
        else:
            yield _p5(worker, n, rng)
