"""The OpenAI protocol's answers: chat completions (JSON and SSE, every fault shape, the
dialects of other OpenAI-compatible providers), embeddings (built by ``embeddings``), the model
list, OpenAI-style error bodies byte for byte like the real API, and real providers' error
answers (``provider_error``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Final

from polygateway.ports import Clock
from polygateway.testing.fake_upstream.embeddings import INVALID_INPUT_MESSAGE, embeddings_answer
from polygateway.testing.fake_upstream.replies import Reply, estimate_tokens, piece_count, split
from polygateway.testing.fake_upstream.wire import (
    BLACK_HOLE,
    CHUNKED_END,
    DONE_FRAME,
    Ask,
    Step,
    chunked_body,
    chunked_head,
    dumps,
    frame,
    json_head,
    json_plan,
    sse_head,
)

DEFAULT_MODEL: Final = "fake-model"

ROUTES: Final[dict[tuple[str, str], str]] = {
    ("POST", "/chat/completions"): "chat",
    ("POST", "/embeddings"): "embeddings",
    ("GET", "/models"): "models",
}
"""(method, path after ``/v1``) -> route name, for the routes these answers serve."""

_EVENT_TAIL_CACHE_LIMIT: Final = 256

_ERROR_DEFAULTS: Final[dict[int, tuple[str, str | None, str]]] = {
    400: ("invalid_request_error", None, "Invalid request (scripted by the fake upstream)."),
    401: (
        "invalid_request_error",
        "invalid_api_key",
        "Incorrect API key provided: sk-fa***ke. You can find your API key in your account.",
    ),
    403: (
        "request_forbidden",
        "unsupported_country_region_territory",
        "Country, region, or territory not supported",
    ),
    404: (
        "invalid_request_error",
        "model_not_found",
        "The model `{model}` does not exist or you do not have access to it.",
    ),
    429: (
        "requests",
        "rate_limit_exceeded",
        "Rate limit reached for {model} on requests per min (RPM): Limit 3, Used 3, "
        "Requested 1. Please try again in 1s.",
    ),
    500: ("server_error", None, "The server had an error processing your request."),
    502: ("server_error", None, "Bad gateway."),
    503: ("server_error", None, "That model is currently overloaded with other requests."),
    504: ("server_error", None, "Gateway timeout."),
}
_QUOTA_MESSAGE: Final = (
    "You exceeded your current quota, please check your plan and billing details."
)
_MID_STREAM_ERROR: Final = {
    "message": "Upstream provider disconnected",
    "type": "server_error",
    "param": None,
    "code": "server_error",
}

_QUOTA_BODY: Final = {
    "error": {
        "message": _QUOTA_MESSAGE,
        "type": "insufficient_quota",
        "param": None,
        "code": "insufficient_quota",
    }
}

PROVIDER_ERRORS: Final[dict[str, tuple[int, dict[str, Any]]]] = {
    # DashScope (Qwen) compatible mode: arrears on a 400 (Model Studio "Error codes").
    "dashscope-arrearage": (
        400,
        {
            "error": {
                "code": "Arrearage",
                "param": None,
                "message": "Access denied, please make sure your account is in good standing.",
                "type": "Arrearage",
            },
            "id": "chatcmpl-fake-arrearage",
            "request_id": "00000000-0000-0000-0000-000000000000",
        },
    ),
    # Zhipu (open.bigmodel.cn): business code 1113 inside a 429 ("balance insufficient or no
    # resource package, please recharge"; docs.z.ai "API codes").
    "zhipu-1113": (
        429,
        {"error": {"code": "1113", "message": "余额不足或无可用资源包,请充值。"}},
    ),
    # DeepSeek: 402 "Insufficient Balance" (api-docs.deepseek.com "Error codes").
    "deepseek-402": (
        402,
        {
            "error": {
                "message": "Insufficient Balance",
                "type": "unknown_error",
                "param": None,
                "code": "invalid_request_error",
            }
        },
    ),
    # OpenAI's 429 insufficient_quota, and the same through a relay that drops code and type.
    "openai-quota": (429, _QUOTA_BODY),
    "relay-quota-no-code": (
        429,
        {"error": {"message": _QUOTA_MESSAGE, "type": None, "param": None, "code": None}},
    ),
    # A rate limit whose code is null: transient.
    "rate-limit-null-code": (
        429,
        {
            "error": {
                "message": "Rate limit reached for requests. Please try again in 1s.",
                "type": "requests",
                "param": None,
                "code": None,
            }
        },
    ),
    # Groq: a tool call the model could not produce (deterministic for this request).
    "groq-tool-use-failed": (
        400,
        {
            "error": {
                "message": "Failed to call a function. Please adjust your prompt. See "
                "'failed_generation' for more details.",
                "type": "invalid_request_error",
                "code": "tool_use_failed",
                "failed_generation": '<function=get_weather>{"city": 1}</function>',
            }
        },
    ),
    # OpenAI: the prompt does not fit the model's context window.
    "openai-context-length": (
        400,
        {
            "error": {
                "message": "This model's maximum context length is 8192 tokens. However, your "
                "messages resulted in 9000 tokens. Please reduce the length of the messages.",
                "type": "invalid_request_error",
                "param": "messages",
                "code": "context_length_exceeded",
            }
        },
    ),
    # OpenAI: a request that conflicts with one in flight (the SDKs retry 409).
    "openai-409": (
        409,
        {
            "error": {
                "message": "Another request is currently being processed. Try again.",
                "type": "invalid_request_error",
                "param": None,
                "code": "conflict",
            }
        },
    ),
}
"""Real providers' error answers, as ``(status, body)`` (shapes copied from their docs)."""


def provider_error(name: str, *, headers: dict[str, str] | None = None) -> Reply:
    """``Reply.error`` with the status and body of a real provider's error answer, by name
    (see ``PROVIDER_ERRORS``); ``headers`` adds response headers."""
    try:
        status, body = PROVIDER_ERRORS[name]
    except KeyError:
        raise ValueError(
            f"unknown provider error {name!r}; known: {', '.join(sorted(PROVIDER_ERRORS))}"
        ) from None
    return Reply.error(status, body=dumps(body), headers=headers)


def provider_error_event(name: str) -> dict[str, Any]:
    """The error object of ``PROVIDER_ERRORS[name]``, for ``Reply.mid_stream_error(error=...)``
    (the same failure reported in the middle of a stream)."""
    error = PROVIDER_ERRORS[name][1]["error"]
    return dict(error)


def _event_tail(delta: str, finish_reason: str, include_usage: bool) -> bytes:
    """A chunk event after ``..."delta":``: the delta, the finish reason and the usage key
    (present as ``null`` only when the request asked for the usage chunk)."""
    tail = ',"usage":null}\n\n' if include_usage else "}\n\n"
    return f'{delta},"logprobs":null,"finish_reason":{finish_reason}}}]{tail}'.encode()


def message_text(messages: Any) -> str:
    if not isinstance(messages, list):
        return ""
    parts: list[str] = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(
                part["text"]
                for part in content
                if isinstance(part, dict) and isinstance(part.get("text"), str)
            )
    return "".join(parts)


class OpenAIAnswers:
    """Plans of the OpenAI routes. Keeps a small cache of stream event bytes (only ``id``,
    ``created`` and ``model`` vary between requests)."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._event_tail_cache: dict[
            tuple[str, int | None, str | None, bool, str], list[bytes]
        ] = {}

    def plan(self, ask: Ask) -> list[Step]:
        reply = ask.reply
        if reply.kind == "error":
            return self._scripted_error_plan(reply, ask.model, ask.close)
        if reply.kind == "flood":
            return _flood_plan(ask, int(self._clock.time()))
        if ask.route == "chat":
            if ask.body.get("stream"):
                return self._chat_stream_plan(ask)
            return self._chat_json_plan(ask)
        if ask.route == "embeddings":
            answer = embeddings_answer(ask)
            if answer is None:
                return self.error(
                    400, "invalid_request_error", None, INVALID_INPUT_MESSAGE, ask.close
                )
            return _json_answer(reply, answer, ask.close)
        models = {
            "object": "list",
            "data": [
                {"id": m, "object": "model", "created": 0, "owned_by": "fake-upstream"}
                for m in ask.models
            ],
        }
        return _json_answer(reply, models, ask.close)

    def error(
        self,
        status: int,
        type_: str,
        code: str | None,
        message: str,
        close: bool,
        extra_headers: str = "",
    ) -> list[Step]:
        """An OpenAI-style error answer (also the server's own 400/404/500 answers)."""
        payload = {"error": {"message": message, "type": type_, "param": None, "code": code}}
        data = dumps(payload).encode()
        return [json_head(len(data), close, status, extra_headers) + data]

    def _scripted_error_plan(self, reply: Reply, model: str, close: bool) -> list[Step]:
        status = reply.status
        default_type, default_code, default_message = _ERROR_DEFAULTS.get(
            status, ("server_error" if status >= 500 else "invalid_request_error", None, "Error.")
        )
        if reply.quota:
            default_type = default_code = "insufficient_quota"
            default_message = _QUOTA_MESSAGE
        extra = "".join(f"{name}: {value}\r\n" for name, value in reply.headers)
        if reply.retry_after is not None:
            value = reply.retry_after
            text = value if isinstance(value, str) else f"{value:g}"
            extra += f"Retry-After: {text}\r\n"
        if reply.body is not None:
            data = reply.body.encode() if isinstance(reply.body, str) else reply.body
            steps: list[Step] = [json_head(len(data), close, status, extra) + data]
        else:
            steps = self.error(
                status,
                reply.error_type or default_type,
                reply.error_code or default_code,
                reply.error_message or default_message.format(model=model),
                close,
                extra,
            )
        if reply.headers_delay:
            steps.insert(0, reply.headers_delay)
        return steps

    def _completion_parts(
        self, reply: Reply, request_json: dict[str, Any]
    ) -> tuple[str, str | None]:
        content = reply.content
        text = content(request_json) if callable(content) else content
        if not isinstance(text, str):
            raise TypeError(f"Reply content callable must return str, got {type(text).__name__}")
        if reply.reasoning is not None and reply.think_inline and reply.dialect == "openai":
            return f"<think>{reply.reasoning}</think>{text}", None
        return text, reply.reasoning

    def _usage(
        self,
        reply: Reply,
        request_json: dict[str, Any],
        content: str,
        reasoning: str | None,
    ) -> dict[str, Any]:
        prompt = reply.prompt_tokens
        if prompt is None:
            prompt = estimate_tokens(message_text(request_json.get("messages")))
        reasoning_tokens = estimate_tokens(reasoning) if reasoning else 0
        completion = reply.completion_tokens
        if completion is None:
            completion = estimate_tokens(content) + reasoning_tokens
        usage: dict[str, Any] = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        if reply.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": reply.cached_tokens}
        if reasoning:
            usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
        return usage

    def _chat_json_plan(self, ask: Ask) -> list[Step]:
        reply, request_json, model = ask.reply, ask.body, ask.model
        content, reasoning = self._completion_parts(reply, request_json)
        message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
        dialect = reply.dialect
        if dialect == "mistral":
            parts: list[dict[str, Any]] = []
            if reasoning is not None:
                parts.append(_thinking_part(reasoning))
            parts.append({"type": "text", "text": content})
            message["content"] = parts
        elif dialect == "openrouter" and reasoning is not None:
            message["reasoning_details"] = [
                _reasoning_detail(reasoning),
                {"type": "reasoning.encrypted", "data": "ZmFrZQ==", "format": "unknown"},
            ]
        elif reasoning is not None:
            message["reasoning_content"] = reasoning
        if reply.tool_calls:
            message["content"] = content or None
            message["tool_calls"] = [
                {"id": id_, "type": "function", "function": {"name": name, "arguments": args}}
                for id_, name, args in reply.tool_calls
            ]
        answer: dict[str, Any] = {
            "id": f"chatcmpl-fake{ask.serial}",
            "object": "chat.completion",
            "created": int(self._clock.time()),
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": reply.finish_reason,
                }
            ],
        }
        if reply.include_usage is not False:
            usage = self._usage(reply, request_json, content, reasoning)
            if dialect == "groq":
                answer["x_groq"] = {"id": f"req_fake{ask.serial}", "usage": usage}
            else:
                answer["usage"] = usage
        pieces = piece_count(content, reply.chunks) + piece_count(reasoning or "", None)
        return _json_answer(reply, answer, ask.close, pieces)

    def _token_event_tails(
        self, content: str, reply: Reply, reasoning: str | None, include_usage: bool
    ) -> list[bytes]:
        """Each token chunk's bytes after the per-request prefix (reasoning first), cached:
        only ``id``, ``created`` and ``model`` vary between requests."""
        dialect = reply.dialect
        key = (content, reply.chunks, reasoning, include_usage, dialect)
        cached = self._event_tail_cache.get(key)
        if cached is not None:
            return cached
        if dialect == "mistral":
            thought = split(reasoning or "", None)
            deltas = [dumps({"content": [_thinking_part(piece)]}) for piece in thought]
            deltas += [
                dumps({"content": [{"type": "text", "text": piece}]})
                for piece in split(content, reply.chunks)
            ]
        elif dialect == "openrouter" and reasoning is not None:
            deltas = [
                dumps({"content": "", "reasoning_details": [_reasoning_detail(piece)]})
                for piece in split(reasoning, None)
            ]
            deltas += [dumps({"content": piece}) for piece in split(content, reply.chunks)]
        elif reasoning is None:
            deltas = [dumps({"content": piece}) for piece in split(content, reply.chunks)]
        else:
            deltas = [
                dumps({"content": None, "reasoning_content": piece})
                for piece in split(reasoning, None)
            ]
            deltas += [
                dumps({"content": piece, "reasoning_content": None})
                for piece in split(content, reply.chunks)
            ]
        tails = [_event_tail(delta, "null", include_usage) for delta in deltas]
        if len(self._event_tail_cache) >= _EVENT_TAIL_CACHE_LIMIT:
            self._event_tail_cache.clear()
        self._event_tail_cache[key] = tails
        return tails

    def _chat_stream_plan(self, ask: Ask) -> list[Step]:
        reply, request_json, model, close = ask.reply, ask.body, ask.model, ask.close
        content, reasoning = self._completion_parts(reply, request_json)
        include_usage = reply.include_usage
        if include_usage is None:
            options = request_json.get("stream_options")
            include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        base = (
            f'{{"id":"chatcmpl-fake{ask.serial}","object":"chat.completion.chunk",'
            f'"created":{int(self._clock.time())},"model":{dumps(model)},'
        )
        prefix = f'data: {base}"choices":[{{"index":0,"delta":'.encode()
        prefix_length = len(prefix)

        def event(tail: bytes) -> bytes:
            return b"%x\r\n%b%b\r\n" % (prefix_length + len(tail), prefix, tail)

        role = (
            '{"role":"assistant","content":""}'
            if reasoning is None or reply.dialect != "openai"
            else '{"role":"assistant","content":null,"reasoning_content":""}'
        )
        kind = reply.kind
        steps: list[Step] = []
        if reply.headers_delay:
            steps.append(reply.headers_delay)
        if kind == "early_eof":
            steps.append(sse_head(close) + CHUNKED_END)
            return steps
        pending = bytearray(sse_head(close))
        pending += event(_event_tail(role, "null", include_usage))
        tails = self._token_event_tails(content, reply, reasoning, include_usage)
        if reply.tool_calls:
            tails = tails + _tool_call_tails(reply, include_usage)
        faulty = kind in ("cut", "malformed", "mid_stream_error", "stall")
        sent = tails[: reply.after_chunks] if faulty else tails
        if reply.first_token_delay or reply.inter_token_delay:
            for index, tail in enumerate(sent):
                delay = reply.first_token_delay if index == 0 else reply.inter_token_delay
                if delay:
                    steps += [bytes(pending), delay]
                    pending.clear()
                pending += event(tail)
        else:
            pending += b"".join([event(tail) for tail in sent])
        if kind == "cut":
            pending += CHUNKED_END
            steps.append(bytes(pending))
            return steps
        if kind == "stall":
            steps += [bytes(pending), BLACK_HOLE]
            return steps
        if kind == "mid_stream_error":
            error = reply.event_error if reply.event_error is not None else _MID_STREAM_ERROR
            pending += frame(b"data: " + dumps({"error": error}).encode() + b"\n\n")
            pending += CHUNKED_END
            steps.append(bytes(pending))
            return steps
        if kind == "malformed":
            pending += event(b'{"content":"unterminated\n\n')
            for tail in tails[reply.after_chunks :]:
                pending += event(tail)
        if reply.dialect == "groq":
            # Groq: no usage chunk; the finish chunk carries x_groq.usage, asked for or not.
            usage = dumps(self._usage(reply, request_json, content, reasoning))
            pending += frame(
                f'data: {base}"choices":[{{"index":0,"delta":{{}},"logprobs":null,'
                f'"finish_reason":{dumps(reply.finish_reason)}}}],'
                f'"x_groq":{{"id":"req_fake{ask.serial}","usage":{usage}}}}}\n\n'.encode()
            )
            pending += DONE_FRAME
            steps.append(bytes(pending))
            return steps
        pending += event(_event_tail("{}", dumps(reply.finish_reason), include_usage))
        if include_usage:
            usage = dumps(self._usage(reply, request_json, content, reasoning))
            pending += frame(f'data: {base}"choices":[],"usage":{usage}}}\n\n'.encode())
        pending += CHUNKED_END if kind == "no_done" else DONE_FRAME
        steps.append(bytes(pending))
        return steps


_FLOOD_PIECE: Final = 64 * 1024


def _tool_call_tails(reply: Reply, include_usage: bool) -> list[bytes]:
    """OpenAI's streamed tool calls: per call, its id and name with empty arguments, then
    the arguments in pieces, each fragment addressed by the call's ``index``."""
    tails = []
    for index, (id_, name, args) in enumerate(reply.tool_calls):
        head = {"index": index, "id": id_, "type": "function"}
        head["function"] = {"name": name, "arguments": ""}
        deltas = [{"tool_calls": [head]}]
        deltas += [
            {"tool_calls": [{"index": index, "function": {"arguments": piece}}]}
            for piece in split(args, reply.chunks)
        ]
        tails += [_event_tail(dumps(delta), "null", include_usage) for delta in deltas]
    return tails


def _flood_plan(ask: Ask, created: int) -> list[Step]:
    """``Reply.flood``: a well-formed answer of about ``size`` bytes, generated as it is sent."""
    reply = ask.reply
    size = reply.size
    encoding = "Content-Encoding: gzip\r\n" if reply.gzip else ""

    def start(kind: str) -> str:
        return (
            f'{{"id":"chatcmpl-fake{ask.serial}","object":"chat.completion{kind}",'
            f'"created":{created},"model":{dumps(ask.model)},"choices":[{{"index":0,'
        )

    if ask.body.get("stream"):
        event = (
            "data: "
            + start(".chunk")
            + '"delta":{"content":"'
            + reply.fill * 1000
            + '"},"logprobs":null,"finish_reason":null}]}\n\n'
        ).encode()
        finish = (
            "data: "
            + start(".chunk")
            + '"delta":{},"logprobs":null,"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'
        ).encode()

        def events() -> Iterator[bytes]:
            per_piece = max(1, _FLOOD_PIECE // len(event))
            count = max(1, size // len(event))
            while count > 0:
                batch = min(per_piece, count)
                yield event * batch
                count -= batch
            yield finish

        head = chunked_head(200, "text/event-stream", ask.close, encoding)
        return [head, chunked_body(events(), gzip=reply.gzip)]
    prefix = (start("") + '"message":{"role":"assistant","content":"').encode()
    suffix = b'"},"logprobs":null,"finish_reason":"stop"}]}'

    def document() -> Iterator[bytes]:
        yield prefix
        left = max(1, size - len(prefix) - len(suffix))
        block = reply.fill.encode() * _FLOOD_PIECE
        while left > 0:
            piece = block if left >= _FLOOD_PIECE else block[:left]
            yield piece
            left -= len(piece)
        yield suffix

    head = chunked_head(200, "application/json", ask.close, encoding)
    return [head, chunked_body(document(), gzip=reply.gzip)]


_MID_STREAM_ERROR_BODY: Final = dumps({"error": _MID_STREAM_ERROR}).encode()


def _thinking_part(text: str) -> dict[str, Any]:
    """A Mistral (Magistral) thinking content part."""
    return {"type": "thinking", "thinking": [{"type": "text", "text": text}]}


def _reasoning_detail(text: str) -> dict[str, Any]:
    """An OpenRouter ``reasoning_details`` text item."""
    return {"type": "reasoning.text", "text": text, "format": "unknown", "index": 0}


def _json_answer(reply: Reply, answer: dict[str, Any], close: bool, pieces: int = 1) -> list[Step]:
    error = (
        _MID_STREAM_ERROR_BODY
        if reply.event_error is None
        else dumps({"error": reply.event_error}).encode()
    )
    return json_plan(reply, dumps(answer).encode(), error, close, pieces)
