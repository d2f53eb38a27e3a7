"""The D14 ladder through GatewayClient and the fake upstream (ARCHITECTURE §7.9)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from features_helpers import (  # make_rig_fixture provides the make_rig fixture
    MESSAGES,
    PRICES,
    RigFactory,
    cost,
    make_rig_fixture,  # noqa: F401
    scope,
    source,
)
from polygateway import GatewayClient, hookimpl
from polygateway.errors import ConfigError, RequestRejectedError, ResultInvalidError
from polygateway.middleware.structured import (
    FEEDBACK_ERROR_CHARS,
    TRUNCATED_ERROR,
    StructuredMiddleware,
    feedback_message,
)
from polygateway.plugins import load_registry
from polygateway.ports import ProviderProfile
from polygateway.settings import BreakerSettings
from polygateway.structured.json_repair import JsonRepairStrategy
from polygateway.testing import FakeUpstream, Reply
from pydantic import BaseModel

VALID = '{"name": "Paris", "country": "FR"}'


class City(BaseModel):
    name: str
    country: str


class Wide(BaseModel):
    a: int
    b: int
    c: int
    d: int
    e: int


def bodies(fake: FakeUpstream, name: str = "a") -> list[dict[str, Any]]:
    return [r.body for r in fake.received(name)]


async def test_invalid_json_then_valid_after_feedback(
    make_rig: RigFactory, fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    fake_upstream.script(
        "a", Reply.ok(content="The capital is Paris, in France."), Reply.ok(content=VALID)
    )
    rig = make_rig(tmp_path, scope(fake_upstream))
    messages = copy.deepcopy(MESSAGES)
    async with rig.client as client:
        response = await client.chat(messages, structured=City)
    assert response.structured_data == City(name="Paris", country="FR")
    assert fake_upstream.requests("a") == 2
    first, second = bodies(fake_upstream)
    assert first["messages"] == MESSAGES
    assert second["messages"][:-2] == MESSAGES
    assert second["messages"][-2] == {
        "role": "assistant",
        "content": "The capital is Paris, in France.",
    }
    feedback = second["messages"][-1]
    assert feedback["role"] == "user"
    assert "no JSON object or array found" in feedback["content"]
    assert "Reply again with only the corrected JSON" in feedback["content"]
    assert messages == MESSAGES  # the caller's list is untouched


async def test_validation_errors_are_the_feedback(
    make_rig: RigFactory, fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    fake_upstream.script("a", Reply.ok(content='{"name": "Paris"}'), Reply.ok(content=VALID))
    rig = make_rig(tmp_path, scope(fake_upstream))
    async with rig.client as client:
        response = await client.chat(MESSAGES, structured=City)
    assert response.structured_data == City(name="Paris", country="FR")
    feedback = bodies(fake_upstream)[1]["messages"][-1]["content"]
    assert "- country: Field required" in feedback


async def test_exhausted_ladder_raises_with_raw_text_and_errors(
    make_rig: RigFactory, fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    fake_upstream.script(
        "a", Reply.ok(content='{"name": 1}'), Reply.ok(content='{"name": "Paris", "country": 7}')
    )
    rig = make_rig(tmp_path, scope(fake_upstream))  # max_structured_retries defaults to 1
    async with rig.client as client:
        with pytest.raises(ResultInvalidError) as caught:
            await client.chat(MESSAGES, structured=City)
    error = caught.value
    assert fake_upstream.requests("a") == 2
    assert error.attempts == 2
    assert error.raw_text == '{"name": "Paris", "country": 7}'
    assert error.validation_errors == ("country: Input should be a valid string (got 7)",)
    assert error.repair_errors == ()
    assert "after 2 attempt(s)" in str(error)


async def test_max_structured_retries_zero_makes_one_request(
    make_rig: RigFactory, fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    fake_upstream.set_default("a", Reply.ok(content="not json"))
    rig = make_rig(tmp_path, scope(fake_upstream, max_structured_retries=0))
    async with rig.client as client:
        with pytest.raises(ResultInvalidError) as caught:
            await client.chat(MESSAGES, structured=City)
    assert fake_upstream.requests("a") == 1
    assert caught.value.attempts == 1
    assert caught.value.raw_text == "not json"
    assert caught.value.repair_errors


async def test_retries_are_bounded_by_the_setting(
    make_rig: RigFactory, fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    fake_upstream.set_default("a", Reply.ok(content="still not json"))
    rig = make_rig(tmp_path, scope(fake_upstream, max_structured_retries=3))
    async with rig.client as client:
        with pytest.raises(ResultInvalidError) as caught:
            await client.chat(MESSAGES, structured=City)
    assert fake_upstream.requests("a") == 4
    assert caught.value.attempts == 4
    # Each re-ask carries only the latest bad output, not a growing history.
    assert all(len(body["messages"]) == len(MESSAGES) + 2 for body in bodies(fake_upstream)[1:])


async def test_feedback_lists_the_first_three_errors(
    make_rig: RigFactory, fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    fake_upstream.script(
        "a", Reply.ok(content="{}"), Reply.ok(content='{"a":1,"b":2,"c":3,"d":4,"e":5}')
    )
    rig = make_rig(tmp_path, scope(fake_upstream))
    async with rig.client as client:
        response = await client.chat(MESSAGES, structured=Wide)
    assert response.structured_data == Wide(a=1, b=2, c=3, d=4, e=5)
    feedback = bodies(fake_upstream)[1]["messages"][-1]["content"]
    listed = [line for line in feedback.splitlines() if line.startswith("- ")]
    assert listed == ["- a: Field required", "- b: Field required", "- c: Field required"]


def test_feedback_cuts_each_error_at_200_characters() -> None:
    text = feedback_message(["x" * 500, "short", "multi\nline   error", "fourth"])
    lines = [line for line in text.splitlines() if line.startswith("- ")]
    assert len(lines) == 3
    assert len(lines[0]) == 2 + FEEDBACK_ERROR_CHARS
    assert lines[0].endswith("...")
    assert lines[1:] == ["- short", "- multi line error"]


async def test_callers_messages_are_never_mutated(
    make_rig: RigFactory, fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    fake_upstream.script("a", Reply.ok(content="nope"), Reply.ok(content="nope"))
    messages = [
        {"role": "system", "content": "Answer in JSON."},
        {"role": "user", "content": [{"type": "text", "text": "capital of France?"}]},
    ]
    snapshot = copy.deepcopy(messages)
    ids = [id(m) for m in messages]
    rig = make_rig(tmp_path, scope(fake_upstream))
    async with rig.client as client:
        with pytest.raises(ResultInvalidError):
            await client.chat(messages, structured=City)
    assert messages == snapshot
    assert [id(m) for m in messages] == ids


async def test_json_mode_repairs_without_reasking(
    make_rig: RigFactory, fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    fake_upstream.script("a", Reply.ok(content='Here:\n```json\n{"items": [1, 2,]}\n```'))
    fake_upstream.set_default("a", Reply.ok(content="no json here"))
    rig = make_rig(tmp_path, scope(fake_upstream, max_structured_retries=3))
    async with rig.client as client:
        ok = await client.chat(MESSAGES, structured="json")
        with pytest.raises(ResultInvalidError) as caught:
            await client.chat(MESSAGES, structured="json", cache_salt="other")
    assert ok.structured_data == {"items": [1, 2]}
    assert caught.value.attempts == 1
    assert fake_upstream.requests("a") == 2


async def test_truncated_output_is_never_repaired(
    make_rig: RigFactory, fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    truncated = Reply.ok(content='{"name": "Par', finish_reason="length")
    fake_upstream.script("a", truncated, truncated, Reply.ok(content=VALID))
    rig = make_rig(tmp_path, scope(fake_upstream))
    async with rig.client as client:
        # "json" mode: refused at once (json-repair would have "completed" it).
        with pytest.raises(ResultInvalidError) as caught:
            await client.chat(MESSAGES, structured="json")
        assert caught.value.repair_errors == (TRUNCATED_ERROR,)
        # A model: the truncation is a failed rung, re-asked with the feedback.
        response = await client.chat(MESSAGES, structured=City)
    assert response.structured_data == City(name="Paris", country="FR")
    assert "finish_reason=length" in bodies(fake_upstream)[2]["messages"][-1]["content"]


async def test_native_schema_is_requested_when_every_provider_supports_it(
    make_rig: RigFactory, fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    fake_upstream.set_default("a", Reply.ok(content=VALID))
    fake_upstream.set_default("b", Reply.ok(content=VALID))
    native = scope(
        fake_upstream,
        source(fake_upstream, "a", provider="openai"),
        structured_strategy="auto",
        cache="none",
    )
    rig = make_rig(tmp_path / "native", native)
    async with rig.client as client:
        await client.chat(MESSAGES, structured=City)
        await client.chat(MESSAGES, structured="json")
        await client.chat(MESSAGES)
    with_schema, json_mode, raw = bodies(fake_upstream, "a")
    assert with_schema["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "City", "schema": City.model_json_schema(), "strict": False},
    }
    assert "response_format" not in json_mode
    assert "response_format" not in raw

    mixed = scope(
        fake_upstream,
        source(fake_upstream, "a", provider="openai"),
        source(fake_upstream, "b", provider="generic"),
        structured_strategy="auto",
        cache="none",
    )
    rig = make_rig(tmp_path / "mixed", mixed)
    async with rig.client as client:
        for _ in range(2):
            await client.chat(MESSAGES, structured=City)
    sent = bodies(fake_upstream, "a")[3:] + bodies(fake_upstream, "b")
    assert len(sent) == 2
    assert all("response_format" not in body for body in sent)


async def test_reasks_are_attempts_in_telemetry(
    make_rig: RigFactory, fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    fake_upstream.script(
        "a",
        Reply.ok(content="nope", prompt_tokens=10, completion_tokens=1),
        Reply.ok(content=VALID, prompt_tokens=30, completion_tokens=9),
    )
    rig = make_rig(tmp_path, scope(fake_upstream))
    async with rig.client as client:
        response = await client.chat(MESSAGES, structured=City, session_id="s")
        rows = await rig.rows()
    assert [(r["error"], r["response"]) for r in rows] == [
        ("ResultInvalidError", "nope"),
        (None, VALID),
    ]
    assert rows[1]["call_id"] == response.call_id
    assert [r["cost"] for r in rows] == [
        pytest.approx(cost(PRICES, "model-a", 10, 1)),
        pytest.approx(cost(PRICES, "model-a", 30, 9)),
    ]
    assert "Reply again" in rows[1]["messages"]  # the re-ask's own messages


async def test_invalid_results_count_as_breaker_success(
    make_rig: RigFactory, fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    fake_upstream.set_default("a", Reply.ok(content="never json"))
    settings = scope(fake_upstream, breaker=BreakerSettings(fail_threshold=1, cooldown_s=30.0))
    rig = make_rig(tmp_path, settings)
    async with rig.client as client:
        for i in range(3):
            with pytest.raises(ResultInvalidError):
                await client.chat(MESSAGES, structured=City, cache_salt=str(i))
        assert await client.breaker.state("a") == "closed"
    assert fake_upstream.requests("a") == 6


async def test_a_bad_structured_spec_is_refused_before_any_request(
    make_rig: RigFactory, fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    rig = make_rig(tmp_path, scope(fake_upstream))
    async with rig.client as client:

        class LooksLikeAModel:  # has model_validate, but is not a pydantic model
            @classmethod
            def model_validate(cls, data: Any) -> Any:
                return data

        for bad in ("yaml", dict, City(name="x", country="y"), LooksLikeAModel):
            with pytest.raises(RequestRejectedError, match="pydantic BaseModel subclass"):
                await client.chat(MESSAGES, structured=bad)
    assert fake_upstream.requests() == 0


@pytest.mark.parametrize("bad", [-1, 1.5, True, None])
def test_max_retries_must_be_a_non_negative_int(bad: Any) -> None:
    with pytest.raises(ConfigError, match="max_structured_retries"):
        StructuredMiddleware(JsonRepairStrategy(), providers={}, sources=(), max_retries=bad)


def test_native_schema_only_when_every_source_supports_it() -> None:
    from polygateway.settings import SourceConfig

    def src(name: str, provider: str) -> SourceConfig:
        return SourceConfig(name=name, provider=provider, base_url="http://x", model="m")

    providers = {
        "n1": ProviderProfile("n1", supports_native_schema=True),
        "n2": ProviderProfile("n2", supports_native_schema=True),
        "plain": ProviderProfile("plain"),
    }

    def native(*sources: SourceConfig) -> bool:
        return StructuredMiddleware(
            JsonRepairStrategy(), providers=providers, sources=sources, max_retries=1
        ).native_schema

    assert native(src("a", "n1"), src("b", "n2"))
    assert not native(src("a", "n1"), src("b", "plain"))
    assert not native(src("a", "n1"), src("b", "unregistered"))
    assert not native()


NATIVE_CITY = {
    "type": "json_schema",
    "json_schema": {"name": "City", "schema": City.model_json_schema(), "strict": False},
}


async def test_the_default_strategy_sends_the_native_schema_where_supported(
    make_rig: RigFactory, fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    fake_upstream.set_default("a", Reply.ok(content=VALID))
    fake_upstream.set_default("b", Reply.ok(content=VALID))
    openai = scope(fake_upstream, source(fake_upstream, "a", provider="openai"), cache="none")
    assert openai.structured_strategy == "auto"  # the default: native schema first
    async with make_rig(tmp_path / "openai", openai).client as client:
        response = await client.chat(MESSAGES, structured=City)
    assert response.structured_data == City(name="Paris", country="FR")
    assert bodies(fake_upstream, "a")[0]["response_format"] == NATIVE_CITY

    generic = scope(fake_upstream, source(fake_upstream, "b", provider="generic"), cache="none")
    async with make_rig(tmp_path / "generic", generic).client as client:
        await client.chat(MESSAGES, structured=City)
    assert "response_format" not in bodies(fake_upstream, "b")[0]


@pytest.mark.parametrize("strategy", ["json-repair", "auto"])
async def test_a_reask_escalates_to_the_native_schema_where_supported(
    make_rig: RigFactory, fake_upstream: FakeUpstream, tmp_path: Path, strategy: str
) -> None:
    fake_upstream.script("a", Reply.ok(content="Paris, France"), Reply.ok(content=VALID))
    fake_upstream.script("b", Reply.ok(content="Paris, France"), Reply.ok(content=VALID))
    for route, provider in (("a", "openai"), ("b", "generic")):
        settings = scope(
            fake_upstream,
            source(fake_upstream, route, provider=provider),
            structured_strategy=strategy,
            cache="none",
        )
        async with make_rig(tmp_path / route, settings).client as client:
            response = await client.chat(MESSAGES, structured=City)
        assert response.structured_data == City(name="Paris", country="FR")
    first, reask = bodies(fake_upstream, "a")  # openai: native schema supported
    assert ("response_format" in first) is (strategy == "auto")
    assert reask["response_format"] == NATIVE_CITY  # the re-ask always carries it
    assert reask["messages"][-2] == {"role": "assistant", "content": "Paris, France"}
    sent = bodies(fake_upstream, "b")  # generic: no native schema, ever
    assert len(sent) == 2 and all("response_format" not in body for body in sent)


def _unwrap(data: Any) -> Any:
    """A provider that wraps the object in a one-element list."""
    return data[0] if isinstance(data, list) and len(data) == 1 else data


class _Fixed:
    """A third-party strategy with no normalize hook."""

    def prepare(self, request: Any, schema: Any, profile: Any) -> Any:
        return request

    def parse(self, text: str, schema: Any) -> Any:
        return JsonRepairStrategy().parse(text, schema)


class _FixedPlugin:
    @hookimpl
    def pgw_register_structured(self, register: Any) -> None:
        register("fixed", lambda ctx: _Fixed())


@pytest.mark.parametrize("strategy", ["auto", "json-repair"])
async def test_the_normalize_hook_is_given_through_the_client(
    make_rig: RigFactory, fake_upstream: FakeUpstream, tmp_path: Path, strategy: str
) -> None:
    fake_upstream.set_default("a", Reply.ok(content=f"[{VALID}]"))
    settings = scope(fake_upstream, structured_strategy=strategy, cache="none")
    async with make_rig(tmp_path / "plain", settings).client as client:
        with pytest.raises(ResultInvalidError):  # a list is no City
            await client.chat(MESSAGES, structured=City)
    async with make_rig(tmp_path / "hook", settings, normalize=_unwrap).client as client:
        assert client.components.strategy.normalize is _unwrap  # type: ignore[attr-defined]
        response = await client.chat(MESSAGES, structured=City)
        assert response.structured_data == City(name="Paris", country="FR")
        loose = await client.chat(MESSAGES, structured="json")
        assert loose.structured_data == {"name": "Paris", "country": "FR"}


def test_a_normalize_hook_that_would_be_ignored_is_a_config_error(
    fake_upstream: FakeUpstream,
) -> None:
    with pytest.raises(ConfigError, match="normalize must be a callable"):
        GatewayClient(scope(fake_upstream), normalize="unwrap")  # type: ignore[arg-type]
    registry = load_registry(autoload=False, extra_plugins=[("fixed-strategy", _FixedPlugin())])
    settings = scope(fake_upstream, structured_strategy="fixed")
    GatewayClient(settings, registry=registry)  # fine without a hook
    with pytest.raises(ConfigError, match="'fixed' takes no normalize hook"):
        GatewayClient(settings, registry=registry, normalize=_unwrap)
