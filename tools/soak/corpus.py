"""Corpus loaders of the soak harness: what the scenarios send.

- :func:`synthetic_prompt` / :func:`synthetic_texts`: deterministic texts of a given size (the
  default corpus, so a run needs no data files);
- :func:`messages_from_trace`: a recorded trace (one JSON object per step: ``system``,
  ``user``, ``assistant``, ``tool`` turns, or an OpenAI-style ``messages`` list) back into chat
  messages;
- :func:`replay_messages`: the prompts of an earlier run's telemetry database (the
  ``pgw_calls`` table's ``messages`` column), for replays; replayed calls carry
  ``cache_salt=run_id`` so they never hit what that run cached;
- :func:`tagged`: the ``[tag:...]`` marker that ties every request the fake upstream logged to
  its telemetry rows.

Pure functions (no I/O but :func:`replay_messages` reading its file): unit-tested.
"""

from __future__ import annotations

import json
import random
import re
import sqlite3
from collections.abc import Iterable, Mapping, Sequence
from contextlib import closing
from typing import Any

Message = dict[str, Any]

TAG_RE = re.compile(r"\[tag:([A-Za-z0-9_.:-]+)\]")
_ROLES = ("system", "user", "assistant", "tool")
_WORDS = [
    "invoice",
    "total",
    "amount",
    "customer",
    "order",
    "shipping",
    "region",
    "quarter",
    "report",
    "table",
    "figure",
    "revenue",
    "margin",
    "forecast",
    "contract",
    "clause",
    "party",
    "date",
    "signature",
    "page",
    "section",
    "summary",
]


def tagged(tag: str, text: str) -> str:
    """``text`` with the tag marker in front (tags are ``[A-Za-z0-9_.:-]+``)."""
    if not tag or TAG_RE.fullmatch(f"[tag:{tag}]") is None:
        raise ValueError(f"a tag is one or more of A-Z a-z 0-9 _ . : -, got {tag!r}")
    return f"[tag:{tag}] {text}"


def tag_of(text: str) -> str | None:
    """The first tag in ``text`` (the fake upstream's rule), or None."""
    match = TAG_RE.search(text)
    return match.group(1) if match else None


def synthetic_prompt(seed: int, words: int) -> str:
    """``words`` pseudo-words, the same for the same seed."""
    if words < 1:
        raise ValueError(f"words must be >= 1, got {words}")
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def synthetic_texts(seed: int, count: int, words: int = 12) -> list[str]:
    """``count`` distinct texts for an embedding call."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    return [f"{i}: {synthetic_prompt(seed * 1_000_003 + i, words)}" for i in range(count)]


def messages_from_trace(steps: Iterable[Any]) -> list[Message]:
    """Chat messages restored from trace steps.

    A step is ``{"role": r, "content": c}`` (``tool`` steps keep ``tool_call_id``), or
    ``{"messages": [...]}`` (a whole request, which replaces what came before: the last full
    request wins), or ``{"prompt": text}`` / ``{"response": text}`` (a user / assistant turn).
    Steps of other shapes are skipped; an empty content is dropped. ``ValueError`` when
    nothing usable remains or the last message is not the user's or a tool's (a request to
    replay ends with what the model answers).
    """
    messages: list[Message] = []
    for step in steps:
        if not isinstance(step, Mapping):
            continue
        if isinstance(step.get("messages"), list):
            messages = [dict(m) for m in step["messages"] if _usable(m)]
            continue
        if isinstance(step.get("prompt"), str):
            step = {"role": "user", "content": step["prompt"]}
        elif isinstance(step.get("response"), str):
            step = {"role": "assistant", "content": step["response"]}
        if _usable(step):
            message: Message = {"role": step["role"], "content": step["content"]}
            if step["role"] == "tool" and isinstance(step.get("tool_call_id"), str):
                message["tool_call_id"] = step["tool_call_id"]
            messages.append(message)
    if not messages:
        raise ValueError("the trace holds no usable message")
    if messages[-1]["role"] not in ("user", "tool"):
        raise ValueError(
            f"a replayed request must end with a user or tool message, not {messages[-1]['role']!r}"
        )
    return messages


def _usable(message: Any) -> bool:
    if not isinstance(message, Mapping) or message.get("role") not in _ROLES:
        return False
    content = message.get("content")
    return (isinstance(content, str) and bool(content)) or (
        isinstance(content, list) and bool(content)
    )


def replay_messages(db_path: str, *, limit: int = 1000) -> list[list[Message]]:
    """The distinct prompts of a telemetry database's successful, non-cached rows, oldest
    first (at most ``limit``). Rows whose ``messages`` are digests or not a message list
    (embedding and OCR rows, ``PGW_TELEMETRY_CONTENT=digest``) are skipped."""
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    with closing(sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)) as conn:
        rows = conn.execute(
            "SELECT messages FROM pgw_calls WHERE error IS NULL AND cache_hit = 0 "
            "ORDER BY created_at"
        ).fetchall()
    return distinct_prompts((row[0] for row in rows), limit=limit)


def distinct_prompts(columns: Iterable[str], *, limit: int) -> list[list[Message]]:
    """The ``messages`` columns that are message lists, each once, in order."""
    seen: set[str] = set()
    out: list[list[Message]] = []
    for text in columns:
        if not isinstance(text, str) or text in seen:
            continue
        try:
            value = json.loads(text)
        except ValueError:
            continue
        if not isinstance(value, list):
            continue
        try:
            messages = messages_from_trace(value)
        except ValueError:
            continue
        seen.add(text)
        out.append(messages)
        if len(out) >= limit:
            break
    return out


def with_tag(messages: Sequence[Message], tag: str) -> list[Message]:
    """A copy of ``messages`` whose first user text carries the tag, and only it (the tags of a
    replayed run are dropped; the caller's list and dicts are never changed)."""
    out = [dict(m) for m in messages]
    for message in out:
        if isinstance(message.get("content"), str):
            message["content"] = TAG_RE.sub("", message["content"]).lstrip()
    for message in out:
        if message.get("role") == "user" and isinstance(message.get("content"), str):
            message["content"] = tagged(tag, message["content"])
            return out
    raise ValueError("no user message with text content to carry the tag")
