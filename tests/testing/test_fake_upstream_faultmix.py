"""The fake upstream's fault mix, arrival hook and counters endpoint, and ``pgw fake-upstream
--sources/--arrivals-log``, checked with raw HTTP clients."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from polygateway.testing import FakeUpstream, Reply
from polygateway.testing.fake_upstream import Arrival
from polygateway.testing.fake_upstream.faultmix import (
    apply_sources,
    arrival_record,
    minimal_instance,
    parse_reply,
)

MESSAGES = [{"role": "user", "content": "[tag:w1-7] hello there"}]


def chat(client: httpx.AsyncClient, url: str, **extra: Any) -> Any:
    return client.post(
        url + "/chat/completions", json={"model": "m", "messages": MESSAGES, **extra}
    )


async def test_mix_draws_every_reply_in_proportion_and_is_reproducible() -> None:
    async def statuses(seed: int) -> list[int]:
        async with FakeUpstream() as fake, httpx.AsyncClient() as client:
            fake.mix("a", [(3, Reply.ok()), (1, Reply.error(503))], seed=seed)
            return [(await chat(client, fake.base_url("a"))).status_code for _ in range(200)]

    first = await statuses(1)
    assert first == await statuses(1)
    counts = Counter(first)
    assert set(counts) == {200, 503}
    assert 110 < counts[200] < 190  # 3:1 of 200 draws


async def test_mix_rejects_bad_weights() -> None:
    fake = FakeUpstream()
    with pytest.raises(ValueError, match="weight > 0"):
        fake.mix("a", [(0, Reply.ok())])
    with pytest.raises(ValueError, match="finite"):
        fake.mix("a", [(-1, Reply.ok())])
    with pytest.raises(TypeError, match="Reply"):
        fake.mix("a", [(1, "ok")])  # type: ignore[list-item]


async def test_counters_endpoint_reports_requests_and_high_water_marks() -> None:
    async with FakeUpstream() as fake, httpx.AsyncClient() as client:
        for _ in range(3):
            await chat(client, fake.base_url("a"))
        await chat(client, fake.base_url("b"))
        counters = (await client.get(f"http://127.0.0.1:{fake.port}/_fake/counters")).json()
        assert counters["requests"]["chat"] == {"*": 4, "a": 3, "b": 1}
        assert counters["max_inflight"]["chat"]["a"] == 1
        assert counters["inflight"]["chat"]["*"] == 0
        # The endpoint is not counted as a request of any route.
        assert fake.requests() == 4
        restarted = await client.get(f"http://127.0.0.1:{fake.port}/_fake/counters?restart_max=1")
        assert restarted.json()["max_inflight"]["chat"]["a"] == 1
        assert fake.counters()["max_inflight"]["chat"]["a"] == 0


async def test_on_arrival_sees_every_routed_request_with_its_reply() -> None:
    seen: list[Arrival] = []
    async with FakeUpstream(on_arrival=seen.append) as fake, httpx.AsyncClient() as client:
        fake.set_default("a", Reply.error(401))
        await chat(client, fake.base_url("a"))
        await client.get(f"http://127.0.0.1:{fake.port}/nowhere")
    assert [(a.source, a.route, a.reply.status if a.reply else None) for a in seen] == [
        ("a", "chat", 401)
    ]
    record = arrival_record(seen[0], __import__("re").compile(r"\[tag:([^\]]+)\]"))
    assert record["tag"] == "w1-7" and record["kind"] == "error"
    assert record["prompt_tokens"] > 0 and record["completion_tokens"] == 0


def test_minimal_instance_satisfies_required_properties() -> None:
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "string"},
            "total": {"type": "number"},
            "items": {"type": "array"},
            "kind": {"enum": ["a", "b"]},
            "inner": {"type": "object", "properties": {"ok": {"type": "boolean"}}},
        },
        "required": ["n", "total", "items", "kind", "inner"],
    }
    assert minimal_instance(schema) == {
        "n": "x",
        "total": 1.0,
        "items": [],
        "kind": "a",
        "inner": {"ok": True},
    }


def test_parse_reply_names_the_source_of_a_bad_entry() -> None:
    with pytest.raises(ValueError, match=r"flaky\.mix\[1\]: unknown reply 'teapot'"):
        apply_sources(FakeUpstream(), {"flaky": {"mix": [[1, {"ok": {}}], [1, {"teapot": {}}]]}})
    with pytest.raises(ValueError, match="exactly one of 'reply' and 'mix'"):
        apply_sources(FakeUpstream(), {"a": {}})
    with pytest.raises(ValueError, match="a: "):
        parse_reply({"error": {"status": 200}}, "a")


async def test_structured_ok_answers_the_requested_schema() -> None:
    fake = FakeUpstream()
    apply_sources(fake, {"s": {"reply": {"ok": {"structured": True}}}})
    schema = {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}
    async with fake, httpx.AsyncClient() as client:
        body = (
            await chat(
                client,
                fake.base_url("s"),
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": schema},
                },
            )
        ).json()
        assert json.loads(body["choices"][0]["message"]["content"]) == {"id": 1}
        plain = (await chat(client, fake.base_url("s"))).json()
        assert plain["choices"][0]["message"]["content"] == "Hello from the fake upstream."


def test_cli_serves_the_sources_file_and_logs_arrivals(tmp_path: Path) -> None:
    sources = tmp_path / "sources.json"
    sources.write_text(json.dumps({"dead": {"reply": {"error": {"status": 401}}}}))
    log = tmp_path / "arrivals.jsonl"
    command = [sys.executable, "-m", "polygateway", "fake-upstream", "--port", "0"]
    command += ["--sources", str(sources), "--arrivals-log", str(log)]
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as process:
        try:
            assert process.stdout is not None
            base = process.stdout.readline().strip().removesuffix("/v1")
            body = {"model": "m", "messages": MESSAGES}
            assert httpx.post(f"{base}/dead/v1/chat/completions", json=body).status_code == 401
            assert httpx.post(f"{base}/other/v1/chat/completions", json=body).status_code == 200
            counters = httpx.get(f"{base}/_fake/counters").json()
            assert counters["requests"]["chat"] == {"*": 2, "dead": 1, "other": 1}
        finally:
            process.terminate()
            assert process.wait(timeout=10) == 0
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(x["source"], x["status"], x["tag"]) for x in lines] == [
        ("dead", 401, "w1-7"),
        ("other", 200, "w1-7"),
    ]
    assert lines[1]["completion_tokens"] > 0
