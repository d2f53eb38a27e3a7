"""GatewayClient construction, assembly rules, lifecycle, telemetry wiring and gather_bounded."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import sys
import warnings
from collections.abc import AsyncIterator
from typing import Any

import pytest
from client_helpers import (
    MESSAGES,
    FaultyBreaker,
    FaultyLimiter,
    ScriptedTransport,
    http_client,
    http_settings,
    registry,
)
from polygateway import hookimpl
from polygateway.backends.memory.breaker import InMemoryGate
from polygateway.backends.memory.limiter import InMemoryLimiter
from polygateway.client import GatewayClient, gather_bounded
from polygateway.errors import ClientClosedError, ConfigError, RequestRejectedError
from polygateway.plugins import load_registry
from polygateway.ports import BuildContext, Handler
from polygateway.settings import (
    BackpressureSettings,
    CacheSettings,
    GatewaySettings,
    Limits,
    RetrySettings,
    TelemetrySettings,
)
from polygateway.testing import FakeClock, FakeUpstream, Reply
from polygateway.types import ChatRequest, LLMResponse, TelemetryRecord


@pytest.fixture
async def fake() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream() as server:
        yield server


# --------------------------------------------------------------------------- from_env


@pytest.fixture(autouse=True)
def _no_stray_config_files(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """Run where no ./pgw.toml or ./.env can leak into from_env."""
    monkeypatch.chdir(tmp_path)


async def test_from_env_without_telemetry_works_end_to_end(fake: FakeUpstream) -> None:
    env = {
        "LLM__OPENAI__1__BASE_URL": fake.base_url("openai-1"),
        "LLM__OPENAI__1__MODEL": "gpt-test",
        "LLM__OPENAI__1__API_KEY": "sk-not-shown",
        "PGW_TELEMETRY_BACKEND": "none",
        "PGW_CACHE_BACKEND": "none",
        "PGW_PLUGINS": "",
    }
    async with GatewayClient.from_env(env=env, pipeline_path=None) as client:
        assert client.components.telemetry is None and client.components.cache is None
        response = await client.chat(MESSAGES, session_id="s-1")
        assert response.content and response.source_name == "openai-1"
        assert response.model == "gpt-test" and response.provider == "openai"
        assert "sk-not-shown" not in repr(client) + repr(client.settings)
    assert client.closed
    sent = fake.received("openai-1")
    assert len(sent) == 1 and sent[0].headers["authorization"] == "Bearer sk-not-shown"
    assert sent[0].body["model"] == "gpt-test" and sent[0].body["messages"] == MESSAGES


async def test_from_env_with_a_memory_cache_answers_repeats_from_the_cache(
    fake: FakeUpstream,
) -> None:
    env = {
        "LLM__OPENAI__1__BASE_URL": fake.base_url("a"),
        "LLM__OPENAI__1__MODEL": "gpt-test",
        "PGW_TELEMETRY_BACKEND": "none",
        "PGW_CACHE_BACKEND": "memory",
        "PGW_CACHE_NAMESPACE": "tenant-1",
        "PGW_CACHE_TTL_S": "60",
        "PGW_PLUGINS": "",
    }
    async with GatewayClient.from_env(env=env) as client:
        first = await client.chat(MESSAGES)
        second = await client.chat(MESSAGES)
        other_tenant = await client.chat(MESSAGES, cache_namespace="tenant-2")
    assert not first.cache_hit and second.cache_hit and not other_tenant.cache_hit
    assert second.content == first.content
    assert fake.requests("a") == 2


def test_from_env_without_sources_names_the_keys() -> None:
    with pytest.raises(ConfigError, match="LLM__"):
        GatewayClient.from_env(env={"PGW_PLUGINS": ""})


def test_from_settings_picks_the_scope_and_names_unknown_ones(fake: FakeUpstream) -> None:
    scope = http_settings(fake, ["a"], scope="JUDGE")
    settings = GatewaySettings(scopes={"JUDGE": scope})
    client = GatewayClient.from_settings(settings, "JUDGE", registry=registry())
    assert client.settings is scope
    with pytest.raises(ConfigError, match="configured scopes: JUDGE"):
        GatewayClient.from_settings(settings, "LLM", registry=registry())
    with pytest.raises(TypeError, match="from_settings"):
        GatewayClient(settings, registry=registry())  # type: ignore[arg-type]


# --------------------------------------------------------------------------- assembly rules


@pytest.mark.parametrize(
    ("middleware", "fragment"),
    [
        (("cache", "cache"), "repeated: cache"),
        (("nosuch",), "registered middleware: cache, retry, structured, telemetry"),
    ],
)
def test_bad_middleware_lists_are_config_errors(
    fake: FakeUpstream, middleware: tuple[str, ...], fragment: str
) -> None:
    settings = http_settings(fake, ["a"], middleware=middleware)
    with pytest.raises(ConfigError, match=fragment):
        GatewayClient(settings, registry=registry())


@pytest.mark.parametrize("middleware", [("cache", "telemetry"), ("structured", "cache"), ()])
async def test_the_dispatcher_is_innermost_whatever_the_layer_order(
    fake: FakeUpstream, middleware: tuple[str, ...]
) -> None:
    # Formerly refused ("'retry' must be present and last"): the wrapping layers are free to
    # be ordered, the governed dispatcher is pinned innermost.
    settings = http_settings(fake, ["a"], middleware=middleware)
    async with GatewayClient(settings, registry=registry()) as client:
        assert (await client.chat(MESSAGES)).source_name == "a"
    assert fake.requests() == 1


@pytest.mark.parametrize("middleware", [("telemetry", "retry", "cache"), ("retry",)])
async def test_retry_in_an_old_middleware_list_warns_and_is_ignored(
    fake: FakeUpstream, middleware: tuple[str, ...]
) -> None:
    settings = http_settings(fake, ["a"], middleware=middleware)
    with pytest.warns(DeprecationWarning, match=r"'retry' in the middleware list is deprecated"):
        client = GatewayClient(settings, registry=registry())
    async with client:
        assert (await client.chat(MESSAGES)).source_name == "a"
    assert fake.requests() == 1


def test_a_cache_without_namespace_or_ttl_is_a_config_error(fake: FakeUpstream) -> None:
    settings = http_settings(fake, ["a"], cache=CacheSettings(backend="memory"))
    with pytest.raises(ConfigError) as info:
        GatewayClient(settings, registry=registry())
    text = str(info.value)
    assert "PGW_CACHE_NAMESPACE" in text and "PGW_CACHE_TTL_S" in text


def test_guards_refuse_assembly(fake: FakeUpstream) -> None:
    settings = http_settings(
        fake,
        ["a"],
        source_overrides={"a": {"timeout_s": 100.0}},
        backpressure=BackpressureSettings(lease_ttl_s=10.0),
    )
    with pytest.raises(ConfigError, match="LEASE_TTL_S"):
        GatewayClient(settings, registry=registry())


def test_no_sources_is_a_config_error(fake: FakeUpstream) -> None:
    with pytest.raises(ConfigError, match="no sources configured"):
        GatewayClient(http_settings(fake, []), registry=registry())


def test_unregistered_names_are_config_errors(fake: FakeUpstream) -> None:
    with pytest.raises(ConfigError, match="registered selector names"):
        GatewayClient(http_settings(fake, ["a"], selector="fastest"), registry=registry())


def test_switched_off_layers_are_left_out(fake: FakeUpstream) -> None:
    client = GatewayClient(http_settings(fake, ["a"]), registry=registry())
    assert client.components.cache is None and client.components.telemetry is None
    assert client.components.transports["a"] is not None
    assert set(client.components.providers) >= {"openai", "qwen", "deepseek", "generic"}


class _Trace:
    """A middleware that records the order layers see the request and the response."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name = name
        self.log = log

    async def __call__(self, request: ChatRequest, call_next: Handler) -> LLMResponse:
        self.log.append(f"{self.name}>")
        response = await call_next(request)
        self.log.append(f"<{self.name}")
        return response


async def test_plugin_middleware_runs_in_the_configured_order(fake: FakeUpstream) -> None:
    log: list[str] = []
    seen: list[BuildContext] = []

    class Plugin:
        @hookimpl
        def pgw_register_middleware(self, register: Any) -> None:
            for name in ("outer", "inner"):

                def factory(ctx: BuildContext, name: str = name) -> _Trace:
                    seen.append(ctx)
                    return _Trace(name, log)

                register(name, factory)

    reg = load_registry(autoload=False, extra_plugins=[("pgw-trace", Plugin())])
    settings = http_settings(fake, ["a"], middleware=("outer", "structured", "inner"))
    async with GatewayClient(settings, registry=reg) as client:
        await client.chat(MESSAGES)
    assert log == ["outer>", "inner>", "<inner", "<outer"]
    assert all(ctx.components is client.components for ctx in seen)


class _StructuredOnlyTrace(_Trace):
    structured_only = True


class _StackTrace(_Trace):
    """Also notes which layers' coroutines are running beneath it."""

    def __init__(self, name: str, log: list[str], stacks: list[set[str]]) -> None:
        super().__init__(name, log)
        self.stacks = stacks

    async def __call__(self, request: ChatRequest, call_next: Handler) -> LLMResponse:
        frame = sys._getframe()
        names = set()
        while frame is not None:
            names.add(frame.f_code.co_qualname)
            frame = frame.f_back
        self.stacks.append(names)
        return await super().__call__(request, call_next)


class _MakeStructured(_Trace):
    """Turns every request into a ``structured="json"`` one."""

    async def __call__(self, request: ChatRequest, call_next: Handler) -> LLMResponse:
        return await super().__call__(dataclasses.replace(request, structured="json"), call_next)


async def test_a_structured_only_layer_is_passed_by_unstructured_requests(
    fake: FakeUpstream,
) -> None:
    # ``structured_only = True`` (ports.StructuredOnly): the chain skips the layer, and its
    # coroutine, for a request with structured=None, deciding at the layer's own place.
    log: list[str] = []
    stacks: list[set[str]] = []
    layers = {
        "marker": lambda ctx: _StructuredOnlyTrace("marker", log),
        "inner": lambda ctx: _StackTrace("inner", log, stacks),
        "make-structured": lambda ctx: _MakeStructured("make", log),
    }

    class Plugin:
        @hookimpl
        def pgw_register_middleware(self, register: Any) -> None:
            for name, factory in layers.items():
                register(name, factory)

    reg = load_registry(autoload=False, extra_plugins=[("pgw-trace", Plugin())])
    settings = http_settings(fake, ["a"], middleware=("marker", "structured", "inner"))
    async with GatewayClient(settings, registry=reg) as client:
        await client.chat(MESSAGES)
        assert log == ["inner>", "<inner"]
        assert "StructuredMiddleware.__call__" not in stacks[-1]
        log.clear()
        fake.script("a", Reply.ok(content='{"x": 1}'))
        response = await client.chat(MESSAGES, structured="json")
        assert response.structured_data == {"x": 1}
        assert log == ["marker>", "inner>", "<inner", "<marker"]
        assert "StructuredMiddleware._repair_only" in stacks[-1]
    log.clear()
    settings = http_settings(fake, ["a"], middleware=("make-structured", "marker", "inner"))
    async with GatewayClient(settings, registry=reg) as client:
        fake.script("a", Reply.ok(content='{"x": 1}'))
        await client.chat(MESSAGES)  # made structured further out: the marker sees it
    assert log == ["make>", "marker>", "inner>", "<inner", "<marker", "<make"]


# --------------------------------------------------------------------------- chat() input


@pytest.mark.parametrize(
    ("messages", "fragment"),
    [
        ("hello", "non-empty list"),
        ([], "empty"),
        ([("user", "hi")], r"messages\[0\] must be a mapping"),
        ([{"role": "user"}], "no 'content'"),
    ],
)
async def test_bad_messages_are_rejected_before_any_network(
    fake: FakeUpstream, messages: Any, fragment: str
) -> None:
    async with http_client(fake, ["a"]) as client:
        with pytest.raises(RequestRejectedError, match=fragment):
            await client.chat(messages)
    assert fake.requests() == 0


async def test_structured_without_its_layer_is_rejected(fake: FakeUpstream) -> None:
    settings = http_settings(fake, ["a"], middleware=())
    async with GatewayClient(settings, registry=registry()) as client:
        with pytest.raises(RequestRejectedError, match="'structured' layer"):
            await client.chat(MESSAGES, structured="json")
        assert (await client.chat(MESSAGES)).content
    assert fake.requests() == 1


async def test_chat_passes_per_call_options_down(fake: FakeUpstream) -> None:
    fake.script("a", Reply.ok(content='Sure: {"x": 1}'))
    async with http_client(fake, ["a"]) as client:
        response = await client.chat(MESSAGES, stream=False, structured="json")
    assert fake.received("a")[0].body.get("stream") in (False, None)
    assert response.structured_data == {"x": 1}


# --------------------------------------------------------------------------- lifecycle


async def test_aclose_closes_what_it_built_and_nothing_injected(fake: FakeUpstream) -> None:
    clock = FakeClock()
    limiter = FaultyLimiter(InMemoryLimiter(global_limits=Limits(), lease_ttl_s=60, clock=clock))
    breaker = FaultyBreaker(
        InMemoryGate(fail_threshold=3, cooldown_s=1, probe_ttl_s=60, clock=clock)
    )
    injected_transport = ScriptedTransport()
    recorder = _Recorder()
    client = http_client(
        fake,
        ["a", "b"],
        clock=clock,
        telemetry=TelemetrySettings(backend="none"),
        injected={
            "limiter": limiter,
            "breaker": breaker,
            "transports": {"a": injected_transport},
            "telemetry": recorder,
        },
    )
    assert client.components.transports["a"] is injected_transport
    built = client.components.transports["b"]
    assert built is not injected_transport
    assert (await client.chat(MESSAGES)).source_name == "a"  # scripted: no network
    await client.aclose()
    await client.aclose()  # idempotent
    assert not limiter.closed and not breaker.closed and not injected_transport.closed
    assert recorder.flushes == 1 and not recorder.closed  # flushed, not closed: not ours
    with pytest.raises(ClientClosedError, match="closed"):
        await client.chat(MESSAGES)


async def test_owned_telemetry_is_flushed_and_closed(fake: FakeUpstream, tmp_path: Any) -> None:
    path = str(tmp_path / "t.db")
    settings = http_settings(
        fake, ["a"], telemetry=TelemetrySettings(backend="sqlite", sqlite_path=path)
    )
    async with GatewayClient(settings, registry=registry()) as client:
        await client.chat(MESSAGES)
        recorder = client.components.telemetry
        assert recorder is not None
    import sqlite3

    from polygateway.telemetry.sqlite import TABLE

    with sqlite3.connect(path) as db:
        rows = db.execute(f"select source_name, error from {TABLE}").fetchall()
    assert rows == [("a", None)]


# --------------------------------------------------------------------------- telemetry wiring


class _Recorder:
    """A TelemetryRecorder double that keeps rows in a list."""

    def __init__(self) -> None:
        self.rows: list[TelemetryRecord] = []
        self.flushes = 0
        self.closed = False

    async def record(self, record: TelemetryRecord) -> None:
        self.rows.append(record)

    async def flush(self) -> None:
        self.flushes += 1

    async def aclose(self) -> None:
        self.closed = True


async def _settled(recorder: _Recorder, count: int) -> list[TelemetryRecord]:
    async with asyncio.timeout(5):
        while len(recorder.rows) < count:
            await asyncio.sleep(0)
    return recorder.rows


async def test_every_attempt_is_one_telemetry_row_with_its_own_call_id(fake: FakeUpstream) -> None:
    recorder = _Recorder()
    client = http_client(
        fake,
        ["a", "b"],
        clock=FakeClock(),
        injected={"telemetry": recorder},
        retry=RetrySettings(same_source_attempts=0),  # the 503 switches at once
    )
    fake.script("a", Reply.error(503))
    response = await client.chat(MESSAGES, session_id="s", parent_call_id="p")
    rows = await _settled(recorder, 2)
    assert [(r.source_name, r.error) for r in rows] == [("a", "TransientError"), ("b", None)]
    assert rows[1].call_id == response.call_id and rows[0].call_id != rows[1].call_id
    assert all(r.session_id == "s" and r.parent_call_id == "p" for r in rows)
    await client.aclose()


async def test_rejected_messages_leave_one_row_and_no_request(fake: FakeUpstream) -> None:
    recorder = _Recorder()
    client = http_client(fake, ["a"], injected={"telemetry": recorder})
    with pytest.raises(RequestRejectedError):
        await client.chat([{"role": "user", "content": 42}])
    rows = await _settled(recorder, 1)
    assert [r.error for r in rows] == ["RequestRejectedError"]
    assert fake.requests() == 0
    await client.aclose()


async def test_a_cancelled_call_is_recorded_as_cancelled(fake: FakeUpstream) -> None:
    recorder = _Recorder()
    client = http_client(fake, ["a"], injected={"telemetry": recorder})
    fake.set_default("a", Reply.black_hole())
    task = asyncio.create_task(client.chat(MESSAGES))
    await fake.wait_for_requests(1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    rows = await _settled(recorder, 1)
    assert [(r.source_name, r.error) for r in rows] == [("a", "cancelled")]
    await client.aclose()


# --------------------------------------------------------------------------- gather_bounded


async def test_gather_bounded_keeps_order_and_bounds_concurrency() -> None:
    running = 0
    peak = 0

    async def job(i: int) -> int:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        for _ in range(3 + (7 * i) % 5):  # uneven lengths: finishing order differs
            await asyncio.sleep(0)
        running -= 1
        return i

    calls = [lambda i=i: job(i) for i in range(20)]
    assert await gather_bounded(calls, 4) == list(range(20))
    assert peak == 4


async def test_gather_bounded_accepts_awaitables_and_empty_input() -> None:
    async def value(v: str) -> str:
        return v

    assert await gather_bounded([value("x"), lambda: value("y")], 1) == ["x", "y"]
    assert await gather_bounded([], 3) == []


async def test_gather_bounded_cancels_the_rest_on_the_first_error() -> None:
    cancelled: list[int] = []
    started: list[int] = []

    async def slow(i: int) -> int:
        started.append(i)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(i)
            raise
        return i

    async def boom() -> int:
        await asyncio.sleep(0)
        raise ValueError("boom")

    never_started = slow(99)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "coroutine was never awaited" would fail here
        with pytest.raises(ValueError, match="boom"):
            await gather_bounded([lambda: slow(0), lambda: slow(1), boom, never_started], 3)
        del never_started
        gc.collect()
    assert sorted(cancelled) == [0, 1] and 99 not in started


@pytest.mark.parametrize("concurrency", [0, -1, 1.5])
async def test_gather_bounded_refuses_a_bad_concurrency(concurrency: Any) -> None:
    with pytest.raises(ValueError, match="concurrency"):
        await gather_bounded([], concurrency)


def test_public_exports() -> None:
    import polygateway

    assert polygateway.GatewayClient is GatewayClient
    assert polygateway.gather_bounded is gather_bounded
    assert dataclasses.is_dataclass(LLMResponse)


class _SlowRecorder(_Recorder):
    """Writes in ``record()`` itself (no ``record_nowait``) and takes a while to do it."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def record(self, record: TelemetryRecord) -> None:
        await self.release.wait()
        self.rows.append(record)


async def test_aclose_waits_for_rows_still_being_recorded(fake: FakeUpstream) -> None:
    recorder = _SlowRecorder()
    client = http_client(fake, ["a"], injected={"telemetry": recorder})
    for _ in range(20):
        await client.chat(MESSAGES)
    assert recorder.rows == []  # all 20 are still in the recorder's record()
    closing = asyncio.create_task(client.aclose())
    await asyncio.sleep(0)
    assert not closing.done()  # aclose waits for the rows in flight
    recorder.release.set()
    await closing
    assert len(recorder.rows) == 20
    assert recorder.flushes == 1 and not recorder.closed  # injected: flushed, not closed


_ONE_VALUE_EACH: dict[str, Any] = {
    "model": "other-model",
    "temperature": 0.0,
    "top_p": 1.0,
    "max_tokens": 5,
    "stop": ["x"],
    "seed": 0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "tools": [{"type": "function", "function": {"name": "f"}}],
    "tool_choice": "auto",
    "parallel_tool_calls": False,
    "response_format": {"type": "json_object"},
    "user": "u",
    "extra_body": {},
}


def test_unset_params_make_no_params(fake: FakeUpstream) -> None:
    # The request skips building the parameters when none is set: it must agree with
    # ``call_params`` (the definition) for no parameter and for each one set alone.
    import inspect

    from polygateway.client import call_params
    from polygateway.params import ChatParams

    names = {f.name for f in dataclasses.fields(ChatParams)}
    assert names == set(inspect.signature(call_params).parameters) == set(_ONE_VALUE_EACH)
    client = GatewayClient(http_settings(fake, ["a"]), registry=registry())
    assert client._request(MESSAGES).params is None
    assert call_params() is None
    for name, value in _ONE_VALUE_EACH.items():
        made = client._request(MESSAGES, **{name: value}).params
        assert made is not None and made == call_params(**{name: value}), name


def test_chat_hands_each_keyword_to_its_own_request_parameter() -> None:
    # ``chat`` passes its keywords to ``_request`` by position (cheaper than by name): the
    # two signatures must line up, and the call must name each in ``_request``'s order.
    import ast
    import inspect
    import textwrap

    chat = list(inspect.signature(GatewayClient.chat).parameters)[1:]
    request = list(inspect.signature(GatewayClient._request).parameters)[1:]
    assert request[: len(chat)] == chat and request[len(chat) :] == ["context"]
    tree = ast.parse(textwrap.dedent(inspect.getsource(GatewayClient.chat)))
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "_request"
    ]
    assert len(calls) == 1 and not calls[0].keywords
    assert [arg.id for arg in calls[0].args if isinstance(arg, ast.Name)] == chat
