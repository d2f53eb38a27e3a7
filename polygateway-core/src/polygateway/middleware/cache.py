"""Response cache layer: outside the retry loop, so a hit costs no quota, never meets a breaker
and never reaches the network (ARCHITECTURE §4.3, §7.5; D4).

Key: ``pgw:cache:`` + sha256 of the canonical JSON of ``{model, messages_digest, namespace,
salt, structured}`` (plus ``extra``, the request's ``extra_body``, when it is not empty: other
body parameters mean another answer; and ``args``, the per-call generation parameters of
``polygateway.params``, when any is set). Canonical JSON makes delimiters in tenant ids harmless.

A backend of the caller's own process (``ports.SupportsCacheObjects``, the memory cache) files
an entry under the JSON the key hashes (``key_json``) when it is at most ``OBJECT_KEY_MAX``
characters (the usual call's: about 150), under the key otherwise: nothing leaves the process,
so the text needs no second hash to be short.

Value: the ``LLMResponse`` as JSON, without ``structured_data``; in a backend of the caller's
own process the fields a hit is built from, as they are (``hit_fields``): no encoding per miss,
no decoding per hit. Only what passed the structured ladder is stored (the structured layer is
inside this one), never an empty, a truncated (``finish_reason == "length"``) or a filtered
(``"content_filter"``) completion. A hit is returned with ``cache_hit=True``, ``latency_ms=0``,
``cost=0.0``, a fresh ``call_id`` (the hit is a call of its own in telemetry) and
``structured_data`` rebuilt by the strategy, without network.

The cache is an optimisation: a failing backend or an unreadable entry is a miss plus a
warning (one per outage), never an error of the call.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
from collections.abc import Callable, Iterable
from json.encoder import encode_basestring
from typing import Any

import orjson

from polygateway.digest import canonical_json, messages_digest, sha256_hex
from polygateway.errors import ConfigError, RequestRejectedError, ResultInvalidError
from polygateway.ids import new_call_id
from polygateway.params import identity
from polygateway.ports import (
    CacheBackend,
    Handler,
    StructuredOutputStrategy,
    SupportsCacheNowait,
    SupportsCacheObjects,
)
from polygateway.types import ChatRequest, LLMResponse, ToolCall

logger = logging.getLogger(__name__)

KEY_PREFIX = "pgw:cache:"
OBJECT_KEY_MAX = 256
"""The longest ``key_json`` an in-process backend files an entry under as it is; a longer one
(a large ``extra_body``, a long namespace) goes under its hash, as in any backend. Entries of
the two kinds never meet: a ``key_json`` starts with ``{``, a key with ``KEY_PREFIX``."""

# Stored fields: everything but structured_data (rebuilt on a hit). Unknown names in a stored
# value are ignored and missing ones take their defaults, so entries survive field additions.
_STORED_FIELDS: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(LLMResponse) if f.name != "structured_data"
)
_STORED_FIELD_SET = frozenset(_STORED_FIELDS)
_json_string: Callable[[str], str] = encode_basestring  # a JSON string literal, as json.dumps
_sha256 = hashlib.sha256
# What a hit changes (besides a fresh call_id): served from memory, free, nothing streamed.
_HIT_OVERRIDES: dict[str, Any] = {
    "cache_hit": True,
    "latency_ms": 0,
    "ttft_ms": None,
    "max_inter_token_ms": None,
    "cost": 0.0,
}
SCHEMA_MEMO_SIZE = 1024
DECODED_MEMO_SIZE = 256
"""Entries whose decoded fields a layer keeps, so a repeated hit skips JSON parsing."""
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)
_DECODE = json.JSONDecoder().decode
# Field values orjson encodes as the stdlib reads them back (``orjson_values``); others take
# the stdlib encoder, which raises as it always has.
_ORJSON_VALUE_TYPES = frozenset({str, int, bool, float, type(None)})


def _stored_calls(calls: tuple[ToolCall, ...]) -> list[list[str]] | None:
    """Tool calls as stored: ``[id, name, arguments]`` triples, none as ``null``."""
    return [[c.id, c.name, c.arguments] for c in calls] if calls else None


def _stored_by_name(r: LLMResponse) -> dict[str, Any]:
    """The stored fields by name, in ``_STORED_FIELDS`` order (a test holds the two equal):
    the definition of ``_stored``."""
    return {
        "content": r.content,
        "thinking": r.thinking,
        "model": r.model,
        "provider": r.provider,
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "latency_ms": r.latency_ms,
        "ttft_ms": r.ttft_ms,
        "max_inter_token_ms": r.max_inter_token_ms,
        "cache_hit": r.cache_hit,
        "call_id": r.call_id,
        "source_name": r.source_name,
        "cost": r.cost,
        "usage_source": r.usage_source,
        "finish_reason": r.finish_reason,
        "salvaged": r.salvaged,
        "cached_prompt_tokens": r.cached_prompt_tokens,
        "cache_write_tokens": r.cache_write_tokens,
        "tool_calls": _stored_calls(r.tool_calls),
    }


_FIELD_COUNT = len(_STORED_FIELDS) + 1  # and structured_data


def encode_response(response: LLMResponse) -> str:
    """The cached form of a response: JSON of its fields, without ``structured_data``.

    Encoded by orjson when every value is a plain JSON scalar (this runs on every miss);
    floats may be spelled otherwise than by the stdlib (``1e-05`` as ``0.00001``) but read
    back equal.
    """
    # ``_stored_by_name(response)`` at two fifths of the cost. A response's instance dict
    # holds its fields in order and nothing else (``frozen_dataclass`` writes it at once):
    # copied whole, ``structured_data`` removed. An instance holding more (an attribute set
    # past the frozen guard) takes the definition.
    fields = vars(response).copy()
    if len(fields) == _FIELD_COUNT:
        del fields["structured_data"]
        calls = fields["tool_calls"]
        fields["tool_calls"] = _stored_calls(calls) if calls else None
    else:
        fields = _stored_by_name(response)
    values = fields.values()
    # The usual response, each stored value of its field's declared type, finite floats
    # (``x - x`` is NaN for an infinity and a NaN) and no tool calls, is checked value by
    # value, at a third of the cost of ``orjson_values``, which decides anything else:
    # either way only the types of ``orjson_values`` reach orjson (tested field by field).
    (
        content,
        thinking,
        model,
        provider,
        prompt_tokens,
        completion_tokens,
        latency_ms,
        ttft_ms,
        max_inter_token_ms,
        cache_hit,
        call_id,
        source_name,
        cost,
        usage_source,
        finish_reason,
        salvaged,
        cached_prompt_tokens,
        cache_write_tokens,
        tool_calls,
    ) = values
    if (
        str is type(content) is type(thinking) is type(model) is type(provider)
        and str is type(call_id) is type(source_name) is type(usage_source)
        and int is type(prompt_tokens) is type(completion_tokens) is type(latency_ms)
        and int is type(cached_prompt_tokens) is type(cache_write_tokens)
        and bool is type(cache_hit) is type(salvaged)
        and tool_calls is None
        and (finish_reason is None or type(finish_reason) is str)
        and (ttft_ms is None or (type(ttft_ms) is float and ttft_ms - ttft_ms == 0.0))
        and (
            max_inter_token_ms is None
            or (
                type(max_inter_token_ms) is float and max_inter_token_ms - max_inter_token_ms == 0.0
            )
        )
        and (cost is None or (type(cost) is float and cost - cost == 0.0))
    ) or orjson_values(values):
        try:
            return orjson.dumps(fields).decode("utf-8")
        except orjson.JSONEncodeError:
            pass  # an int beyond 64 bits, a lone surrogate: the stdlib's verdict
    return _ENCODER.encode(fields)


def orjson_values(values: Iterable[Any]) -> bool:
    """Whether orjson encodes ``values`` as the stdlib reads them back: plain JSON scalars
    (exact types), finite floats. orjson would also accept types the stdlib refuses
    (dataclasses, enums, UUIDs...) and write NaN/inf as null where the stdlib refuses them."""
    kinds = set(map(type, values))
    return kinds <= _ORJSON_VALUE_TYPES and (
        float not in kinds or all([math.isfinite(v) for v in values if type(v) is float])
    )


def decode_fields(value: str) -> dict[str, Any]:
    """The ``LLMResponse`` keyword arguments stored by ``encode_response``.

    ``ValueError`` when ``value`` is not such an entry.
    """
    data = _DECODE(value)
    if not isinstance(data, dict) or not isinstance(data.get("content"), str):
        raise ValueError("cached value is not an encoded LLMResponse")
    if not _STORED_FIELD_SET.issuperset(data):
        data = {k: v for k, v in data.items() if k in _STORED_FIELD_SET}
    calls = data.pop("tool_calls", None)
    if calls:
        data["tool_calls"] = tuple(ToolCall(*call) for call in calls)
    return data


def decode_response(value: str, **overrides: Any) -> LLMResponse:
    """Inverse of ``encode_response``; ``ValueError``/``TypeError`` when ``value`` is unusable."""
    fields = decode_fields(value)
    fields.update(overrides)
    return LLMResponse(**fields)


_FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(LLMResponse))


def _hit_fields_by_name(response: LLMResponse) -> dict[str, Any]:
    """``hit_fields`` by name: the definition (a test holds the two equal)."""
    fields = {name: getattr(response, name) for name in _FIELD_NAMES}
    fields["structured_data"] = None
    return fields


def hit_fields(response: LLMResponse) -> dict[str, Any]:
    """What a hit on ``response``'s entry is built from (``hit_response``), kept as it is by a
    backend of the caller's process (``ports.SupportsCacheObjects``): every field of the
    response as it is, but ``structured_data``, ``None`` (a hit's is rebuilt by the strategy;
    an entry holds no parsed model). The values are immutable (strings, numbers, a tuple of
    frozen ``ToolCall``), so hits share them.
    """
    # A response's instance dict holds its fields and nothing else (``frozen_dataclass``
    # writes it at once): copied whole, so that the entry shares no state with the response
    # (the hit's overrides are applied by ``hit_response``). One holding more (an attribute
    # set past the guard) or structured data takes the definition. A plain dict of plain
    # values is no object the garbage collector tracks: an entry kept per miss adds nothing to
    # its passes (measured: a dict subclass, always tracked, cost 3k a call).
    fields = vars(response)
    if len(fields) != _FIELD_COUNT or fields["structured_data"] is not None:
        return _hit_fields_by_name(response)
    return fields.copy()


def _hit_response_by_name(fields: dict[str, Any], call_id: str, data: Any) -> LLMResponse:
    """``hit_response`` by name: the definition (a test holds the two equal)."""
    return LLMResponse(**{**fields, **_HIT_OVERRIDES, "call_id": call_id, "structured_data": data})


def hit_response(fields: dict[str, Any], call_id: str, data: Any) -> LLMResponse:
    """The hit built from an entry's ``fields`` (``hit_fields``, or what ``decode_fields``
    read; fields missing from them take their defaults): served from memory (``cache_hit``, no
    latency, free), ``call_id`` its own (the hit is a call of its own), ``data`` its
    ``structured_data``. ``TypeError`` or ``KeyError`` for fields that are not a response's.
    """
    if len(fields) != _FIELD_COUNT:
        return _hit_response_by_name(fields, call_id, data)
    # Every field: positional, in field order (a test gives every field its own value), as
    # twenty keywords would be matched by name. A dict of twenty keys that are not the
    # fields misses one of them: ``KeyError``, where the keywords raise ``TypeError``.
    return LLMResponse(
        fields["content"],
        fields["thinking"],
        fields["model"],
        fields["provider"],
        fields["prompt_tokens"],
        fields["completion_tokens"],
        0,  # latency_ms
        None,  # ttft_ms
        None,  # max_inter_token_ms
        True,  # cache_hit
        call_id,
        fields["source_name"],
        0.0,  # cost
        fields["usage_source"],
        data,  # structured_data
        fields["finish_reason"],
        fields["salvaged"],
        fields["cached_prompt_tokens"],
        fields["cache_write_tokens"],
        fields["tool_calls"],
    )


_UNCACHEABLE_FINISH = frozenset(("length", "content_filter"))
"""Finish reasons of an answer that must not be replayed: cut by the token limit, or by the
content filter (another sampling may pass; the filter's verdict is not the answer)."""


def is_cacheable(response: LLMResponse) -> bool:
    """A real, complete answer: not a hit already, not empty, not cut off by the token limit or
    the content filter, not salvaged from a stream that ended without ``[DONE]`` (tool calls
    alone are an answer)."""
    return (
        not response.cache_hit
        and not response.salvaged
        and response.finish_reason not in _UNCACHEABLE_FINISH
        and (bool(response.content.strip()) or bool(response.tool_calls))
    )


class CacheMiddleware:
    """Content-addressed response cache over a ``CacheBackend``."""

    __slots__ = (
        "_backend",
        "_decoded",
        "_default_tail",
        "_failing",
        "_get_nowait",
        "_get_object",
        "_model_identity",
        "_model_json",
        "_schema_ids",
        "_set_nowait",
        "_set_object",
        "_strategy",
        "namespace",
        "ttl_s",
    )

    def __init__(
        self,
        backend: CacheBackend,
        *,
        namespace: str,
        ttl_s: float,
        model_identity: str,
        strategy: StructuredOutputStrategy,
    ) -> None:
        problems: list[str] = []
        if type(namespace) is not str or not namespace:
            problems.append(
                "cache namespace is required (PGW_CACHE_NAMESPACE or [cache] namespace): "
                f"a project or tenant name keeps cache entries apart, got {namespace!r}"
            )
        if (
            isinstance(ttl_s, bool)
            or not isinstance(ttl_s, int | float)
            or not math.isfinite(ttl_s)
            or ttl_s <= 0
        ):
            problems.append(
                "cache TTL is required and must be a finite number of seconds > 0 "
                f"(PGW_CACHE_TTL_S or [cache] ttl_s), got {ttl_s!r}"
            )
        if problems:
            raise ConfigError(problems)
        self._backend = backend
        # Backends that answer synchronously (the memory cache) skip a coroutine per lookup
        # and per store, as telemetry recorders with ``record_nowait`` do.
        self._get_nowait: Callable[[str], str | None] | None = None
        self._set_nowait: Callable[[str, str, float], None] | None = None
        if isinstance(backend, SupportsCacheNowait):
            self._get_nowait = backend.get_nowait
            self._set_nowait = backend.set_nowait
        # Backends of the caller's own process keep a hit's fields as they are: no JSON per
        # miss and per hit (measured: most of what the layer cost on a miss).
        self._get_object: Callable[[str], object | None] | None = None
        self._set_object: Callable[[str, object, float], None] | None = None
        if isinstance(backend, SupportsCacheObjects):
            self._get_object = backend.get_object
            self._set_object = backend.set_object
        self.namespace = namespace
        self.ttl_s = float(ttl_s)
        self._model_identity = model_identity
        self._model_json = _json_string(model_identity)
        self._strategy = strategy
        self._schema_ids: dict[type[Any], str] = {}
        # The end of the key's JSON for the usual call (own namespace, no salt, raw text).
        self._default_tail = self._key_tail(namespace, "", None)
        self._decoded: dict[str, dict[str, Any]] = {}
        self._failing = False

    async def __call__(self, request: ChatRequest, call_next: Handler) -> LLMResponse:
        try:
            key: str | None = self.entry_key(request)
        except RequestRejectedError:
            raise
        except (TypeError, ValueError) as exc:
            # Content that cannot be canonicalised (not JSON-able) is sent uncached; whether
            # it is acceptable at all is the transport's call.
            logger.warning("request not cached: its cache key cannot be computed (%s)", exc)
            key = None
        if key is None:  # outside the handler: the call's own errors carry no key error
            return await call_next(request)
        get_object, get_nowait = self._get_object, self._get_nowait
        try:
            cached: object
            if get_object is not None:
                cached = get_object(key)
            elif get_nowait is not None:
                cached = get_nowait(key)
            else:
                cached = await self._backend.get(key)
        except Exception as exc:  # noqa: BLE001 - a cache outage is a miss, never an error
            self._backend_failed("get", exc)
            cached = None
        else:
            if self._failing:
                self._backend_ok()
        if cached is not None:
            hit = self._hit(cached, request)
            if hit is not None:
                return hit
        response = await call_next(request)
        if is_cacheable(response):
            set_object, set_nowait = self._set_object, self._set_nowait
            try:
                if set_object is not None:
                    set_object(key, hit_fields(response), self.ttl_s)
                else:
                    value = encode_response(response)
                    if set_nowait is not None:
                        set_nowait(key, value, self.ttl_s)
                    else:
                        await self._backend.set(key, value, self.ttl_s)
            except (ValueError, TypeError) as exc:  # e.g. NaN or a non-JSON field value
                logger.warning("response not cached: it cannot be encoded (%s)", exc)
            except Exception as exc:  # noqa: BLE001 - a cache outage must not fail a good call
                self._backend_failed("set", exc)
            else:
                if self._failing:
                    self._backend_ok()
        return response

    # ------------------------------------------------------------------ key

    def key(self, request: ChatRequest) -> str:
        """The cache key of ``request``: ``KEY_PREFIX`` + the sha256 of ``key_json(request)``;
        ``RequestRejectedError`` for an unusable salt/namespace."""
        return KEY_PREFIX + sha256_hex(self.key_json(request))

    def entry_key(self, request: ChatRequest) -> str:
        """What this layer's backend files the entry of ``request`` under: ``key(request)``,
        or in a backend of the caller's process ``key_json(request)`` itself when it is at
        most ``OBJECT_KEY_MAX`` characters (no second hash per call)."""
        key_json = self.key_json(request)
        if self._get_object is None or len(key_json) > OBJECT_KEY_MAX:
            return KEY_PREFIX + sha256_hex(key_json)
        return key_json

    def key_json(self, request: ChatRequest) -> str:
        """The canonical JSON of the key's documented parts, what the key hashes.

        The outer JSON object is assembled by hand (keys in sorted order) because this runs on
        every call, hits included.
        """
        context = request.context
        if (
            context is not None
            and request.cache_namespace is None
            and request.cache_salt is None
            and request.structured is None
            and request.params is None
            and not request.extra_body
        ):
            # The usual call (the layer's namespace, no salt, raw text, no parameters): only
            # the messages vary. The call's context encodes them once per call (the telemetry
            # rows store the same string); the key hashes it.
            digest = _sha256(context.canonical_messages_utf8(request.messages)).hexdigest()
            return f'{{"messages_digest":"{digest}"{self._default_tail}'
        return self._key_json(request)

    def _key_json(self, request: ChatRequest) -> str:
        """``key_json`` of any request (the usual one's too: a test holds the two paths
        equal)."""
        structured = request.structured
        namespace, salt = self.namespace, ""
        if request.cache_namespace is not None or request.cache_salt is not None:
            given_namespace = request.cache_namespace or namespace
            given_salt = request.cache_salt or salt
            if type(given_namespace) is not str or type(given_salt) is not str:
                raise RequestRejectedError(
                    "cache_namespace and cache_salt must be strings, got "
                    f"{type(request.cache_namespace).__name__} and "
                    f"{type(request.cache_salt).__name__}"
                )
            namespace, salt = given_namespace, given_salt
        context = request.context
        if context is not None:
            digest = _sha256(context.canonical_messages_utf8(request.messages)).hexdigest()
        else:
            digest = messages_digest(request.messages)
        if structured is None and not salt and namespace == self.namespace:
            tail = self._default_tail
        else:
            tail = self._key_tail(namespace, salt, structured)
        extra, params = request.extra_body, request.params
        head = '{"extra":' + canonical_json(extra) + "," if extra else "{"
        if params is not None:  # the usual call sets none: no identity to ask for
            args = identity(params)
            if args is not None:  # the per-call generation parameters change the answer
                head = '{"args":' + canonical_json(args) + "," + head[1:]
        return f'{head}"messages_digest":"{digest}"{tail}'

    def _key_tail(self, namespace: str, salt: str, structured: Any) -> str:
        """The key's JSON object after ``messages_digest`` (its keys sort after it)."""
        structured_json = (
            "null" if structured is None else _json_string(self._structured_id(structured))
        )
        return (
            f',"model":{self._model_json},"namespace":{_json_string(namespace)}'
            f',"salt":{_json_string(salt)},"structured":{structured_json}}}'
        )

    def _structured_id(self, structured: Any) -> str:
        """``"json"``, or a model's qualified name + a hash of its JSON schema.

        The schema hash keeps an edited model from being served entries of its old shape.
        """
        if structured == "json":
            return "json"
        ident = self._schema_ids.get(structured)
        if ident is None:
            module = getattr(structured, "__module__", "")
            name = f"{module}.{getattr(structured, '__qualname__', structured)}"
            schema_fn = getattr(structured, "model_json_schema", None)
            schema = canonical_json(schema_fn()) if callable(schema_fn) else repr(structured)
            ident = f"{name}:{hashlib.sha256(schema.encode('utf-8')).hexdigest()[:16]}"
            if len(self._schema_ids) >= SCHEMA_MEMO_SIZE:  # models made per call must not leak
                self._schema_ids.clear()
            self._schema_ids[structured] = ident
        return ident

    # ------------------------------------------------------------------ hit

    def _hit(self, cached: object, request: ChatRequest) -> LLMResponse | None:
        fields: dict[str, Any] | None
        if type(cached) is dict:  # kept as it is (ports.SupportsCacheObjects)
            fields = cached
            if type(fields.get("content")) is not str:  # as decode_fields checks an entry
                logger.warning("unreadable cache entry ignored, calling upstream (no content)")
                return None
        elif isinstance(cached, str):
            fields = self._decoded_fields(cached)
            if fields is None:
                return None
        else:
            logger.warning(
                "unreadable cache entry ignored, calling upstream (a %s)", type(cached).__name__
            )
            return None
        structured = request.structured
        if structured is None:
            data = None
        else:
            try:
                data = self._strategy.parse(fields["content"], structured)
            except ResultInvalidError as exc:
                # Stored without this ladder (a custom layer order, say): not usable here.
                logger.warning(
                    "cache entry does not pass the structured ladder, refetching (%s)", exc
                )
                return None
        try:
            # A fresh call_id: the hit is a call of its own (its telemetry row, its id).
            return hit_response(fields, new_call_id(), data)
        except (TypeError, KeyError) as exc:  # a stored field of the wrong kind
            if isinstance(cached, str):
                self._decoded.pop(cached, None)
            logger.warning("unreadable cache entry ignored, calling upstream (%s)", exc)
            return None

    def _decoded_fields(self, cached: str) -> dict[str, Any] | None:
        """A stored string's fields, decoded once per entry (``None``: unreadable)."""
        fields = self._decoded.get(cached)
        if fields is None:
            try:
                fields = decode_fields(cached)
            except (ValueError, TypeError) as exc:
                logger.warning("unreadable cache entry ignored, calling upstream (%s)", exc)
                return None
            decoded = self._decoded
            if len(decoded) >= DECODED_MEMO_SIZE:
                decoded.clear()
            decoded[cached] = fields
        return fields

    # ------------------------------------------------------------------ degradation

    def _backend_failed(self, operation: str, exc: Exception) -> None:
        if not self._failing:
            self._failing = True
            logger.warning(
                "cache backend %s failed, calls go uncached until it recovers: %r", operation, exc
            )

    def _backend_ok(self) -> None:
        if self._failing:
            self._failing = False
            logger.info("cache backend recovered")

    def __repr__(self) -> str:
        return (
            f"CacheMiddleware(namespace={self.namespace!r}, ttl_s={self.ttl_s}, "
            f"backend={self._backend!r})"
        )


__all__ = [
    "DECODED_MEMO_SIZE",
    "KEY_PREFIX",
    "CacheMiddleware",
    "decode_fields",
    "decode_response",
    "encode_response",
    "hit_fields",
    "hit_response",
    "is_cacheable",
]
