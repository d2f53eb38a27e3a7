"""A fault mix for a long-running fake upstream, from JSON: what each source answers, and a
log of every arrival (``pgw fake-upstream --sources FILE --arrivals-log PATH``).

The sources file maps a source name to its behaviour on one route::

    {"healthy":  {"reply": {"ok": {"structured": true}}},
     "bad-key":  {"reply": {"error": {"status": 401}}},
     "void":     {"reply": {"black_hole": {}}},
     "flaky":    {"mix": [[8, {"ok": {}}], [1, {"error": {"status": 429, "retry_after": 1}}],
                          [1, {"error": {"status": 503}}]], "seed": 7},
     "vectors":  {"route": "embeddings", "reply": {"ok": {}}}}

Each reply is ``{constructor: arguments}`` for one of :class:`Reply`'s class methods named in
``CONSTRUCTORS``. ``ok`` also takes ``"structured": true``: the content is then a minimal
instance of the request's ``response_format`` JSON schema (an object for ``json_object``), so
structured-output clients get a valid answer, and plain text otherwise.

The arrivals log is JSON lines, one per request that reached a route, written before it is
answered: ``t`` (server wall clock), ``source``, ``route``, ``tag`` (the first match of the
tag pattern in the request's text, or null), ``kind`` and ``status`` of the reply chosen, and
``prompt_tokens``/``completion_tokens``: the usage the fake reports for that reply (0 for
completion when the reply is not a complete answer).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import IO, Any, Final

from polygateway.testing.fake_upstream.embeddings import _items
from polygateway.testing.fake_upstream.openai import message_text
from polygateway.testing.fake_upstream.replies import DEFAULT_CONTENT, Reply, estimate_tokens
from polygateway.testing.fake_upstream.server import Arrival, FakeUpstream

__all__ = [
    "CONSTRUCTORS",
    "DEFAULT_TAG_PATTERN",
    "ArrivalLog",
    "apply_sources",
    "arrival_record",
    "minimal_instance",
    "parse_reply",
]

CONSTRUCTORS: Final = frozenset(
    {"ok", "error", "black_hole", "cut", "stall", "no_done", "reset", "mid_stream_error", "empty"}
)
DEFAULT_TAG_PATTERN: Final = r"\[tag:([A-Za-z0-9_.:-]+)\]"
_COMPLETE: Final = frozenset({"ok", "no_done"})


def minimal_instance(schema: Any, depth: int = 0) -> Any:
    """The smallest value a JSON schema accepts, as the fake can make one (every required
    property of an object, an empty array, the first enum value...)."""
    if depth > 8 or not isinstance(schema, dict):
        return None
    if schema.get("enum"):
        return schema["enum"][0]
    if "const" in schema:
        return schema["const"]
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return minimal_instance(schema[key][0], depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object" or "properties" in schema:
        properties = schema.get("properties") or {}
        required = schema.get("required") or list(properties)
        return {
            name: minimal_instance(properties.get(name, {}), depth + 1)
            for name in required
            if isinstance(name, str)
        }
    if kind == "array":
        return []
    if kind == "string":
        return "x"
    if kind == "integer":
        return int(schema.get("minimum", 1))
    if kind == "number":
        return float(schema.get("minimum", 1.0))
    if kind == "boolean":
        return True
    return None


def _structured_content(request: Any) -> str:
    fmt = request.get("response_format") if isinstance(request, dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema") or {}
        return json.dumps(minimal_instance(schema))
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return json.dumps({"answer": DEFAULT_CONTENT})
    return DEFAULT_CONTENT


def parse_reply(spec: Any, where: str) -> Reply:
    """``{constructor: {arguments}}`` -> a :class:`Reply`; ``ValueError`` naming ``where``."""
    if not isinstance(spec, dict) or len(spec) != 1:
        raise ValueError(f"{where}: a reply is one {{constructor: arguments}} object, got {spec!r}")
    ((name, args),) = spec.items()
    if name not in CONSTRUCTORS:
        raise ValueError(f"{where}: unknown reply {name!r} (one of {sorted(CONSTRUCTORS)})")
    if not isinstance(args, dict):
        raise ValueError(f"{where}: the arguments of {name!r} must be an object, got {args!r}")
    args = dict(args)
    if name == "ok" and args.pop("structured", False):
        args["content"] = _structured_content
    try:
        reply: Reply = getattr(Reply, name)(**args)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None
    return reply


def apply_sources(fake: FakeUpstream, spec: Mapping[str, Any]) -> None:
    """Configure ``fake`` from a parsed sources file (see the module docstring)."""
    if not isinstance(spec, Mapping):
        raise ValueError("the sources file must hold a JSON object: source -> behaviour")
    for source, behaviour in spec.items():
        if not isinstance(behaviour, dict):
            raise ValueError(f"{source}: the behaviour must be an object, got {behaviour!r}")
        unknown = set(behaviour) - {"route", "reply", "mix", "seed"}
        if unknown:
            raise ValueError(f"{source}: unknown keys {sorted(unknown)}")
        route = behaviour.get("route", "chat")
        if ("reply" in behaviour) == ("mix" in behaviour):
            raise ValueError(f"{source}: give exactly one of 'reply' and 'mix'")
        if "reply" in behaviour:
            fake.set_default(source, parse_reply(behaviour["reply"], source), route=route)
            continue
        weighted = behaviour["mix"]
        if not isinstance(weighted, list) or not weighted:
            raise ValueError(f"{source}: 'mix' is a non-empty list of [weight, reply]")
        pairs: list[tuple[float, Reply]] = []
        for i, item in enumerate(weighted):
            if not (isinstance(item, list) and len(item) == 2):
                raise ValueError(f"{source}: mix[{i}] must be [weight, reply], got {item!r}")
            weight, reply = item
            if not isinstance(weight, int | float) or isinstance(weight, bool):
                raise ValueError(f"{source}: mix[{i}] weight must be a number, got {weight!r}")
            pairs.append((float(weight), parse_reply(reply, f"{source}.mix[{i}]")))
        fake.mix(source, pairs, seed=int(behaviour.get("seed", 0)), route=route)


def _request_text(route: str, body: Any) -> str:
    if not isinstance(body, dict):
        return ""
    if route == "embeddings":
        return "\n".join(item for item in _items(body.get("input")) if isinstance(item, str))
    return message_text(body.get("messages"))


def _usage(route: str, body: Any, reply: Reply | None) -> tuple[int, int]:
    if route == "embeddings":
        items = _items(body.get("input")) if isinstance(body, dict) else []
        prompt = sum(estimate_tokens(i) if isinstance(i, str) else len(i) for i in items)
        return (reply.prompt_tokens if reply and reply.prompt_tokens is not None else prompt), 0
    prompt = estimate_tokens(_request_text(route, body))
    if reply is None:
        return prompt, 0
    if reply.prompt_tokens is not None:
        prompt = reply.prompt_tokens
    if reply.kind not in _COMPLETE:
        return prompt, 0
    if reply.completion_tokens is not None:
        return prompt, reply.completion_tokens
    content = reply.content(body) if callable(reply.content) else reply.content
    completion = estimate_tokens(content) + (
        estimate_tokens(reply.reasoning) if reply.reasoning else 0
    )
    return prompt, completion


def arrival_record(arrival: Arrival, tag_pattern: re.Pattern[str]) -> dict[str, Any]:
    """The arrivals-log line of one request."""
    match = tag_pattern.search(_request_text(arrival.route, arrival.body))
    prompt, completion = _usage(arrival.route, arrival.body, arrival.reply)
    reply = arrival.reply
    return {
        "t": round(arrival.at, 6),
        "source": arrival.source,
        "route": arrival.route,
        "tag": match.group(1) if match else None,
        "kind": reply.kind if reply else None,
        "status": reply.status if reply else None,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
    }


class ArrivalLog:
    """The ``on_arrival`` hook writing :func:`arrival_record` lines to a text file."""

    def __init__(self, out: IO[str], tag_pattern: str = DEFAULT_TAG_PATTERN) -> None:
        self._out = out
        self._pattern = re.compile(tag_pattern)

    def __call__(self, arrival: Arrival) -> None:
        self._out.write(json.dumps(arrival_record(arrival, self._pattern)) + "\n")

    def flush(self) -> None:
        self._out.flush()
