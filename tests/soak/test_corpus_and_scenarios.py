"""The soak harness's corpus loaders and scenario generators (pure functions)."""

from __future__ import annotations

import itertools
import json
import sqlite3
from collections import Counter
from contextlib import closing
from pathlib import Path

import pytest
from corpus import (
    distinct_prompts,
    messages_from_trace,
    replay_messages,
    synthetic_prompt,
    synthetic_texts,
    tag_of,
    tagged,
    with_tag,
)
from scenarios import P6_WEIGHTS, calls


def test_tags_round_trip_and_bad_tags_are_refused() -> None:
    assert tag_of(tagged("w1-r3", "hello")) == "w1-r3"
    assert tag_of("no tag here") is None
    assert tag_of('"[tag:w0-1] x" and [tag:w0-2]') == "w0-1"
    for bad in ("", "w 1", "a]b", "é"):
        with pytest.raises(ValueError, match="tag"):
            tagged(bad, "x")


def test_synthetic_texts_are_deterministic_and_distinct() -> None:
    assert synthetic_prompt(5, 10) == synthetic_prompt(5, 10)
    assert synthetic_prompt(5, 10) != synthetic_prompt(6, 10)
    assert len(synthetic_prompt(1, 7).split()) == 7
    texts = synthetic_texts(3, 20)
    assert len(set(texts)) == 20
    with pytest.raises(ValueError, match="words"):
        synthetic_prompt(1, 0)
    with pytest.raises(ValueError, match="count"):
        synthetic_texts(1, 0)


def test_messages_from_trace_restores_turns_and_full_requests() -> None:
    steps = [
        {"role": "system", "content": "be brief"},
        {"prompt": "hi"},
        {"response": "hello"},
        {"role": "user", "content": ""},  # empty: dropped
        {"kind": "log line"},  # not a turn: skipped
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    assert messages_from_trace(steps) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    whole = [{"prompt": "old"}, {"messages": [{"role": "user", "content": "new"}]}]
    assert messages_from_trace(whole) == [{"role": "user", "content": "new"}]


def test_messages_from_trace_refuses_unusable_traces() -> None:
    with pytest.raises(ValueError, match="no usable message"):
        messages_from_trace([{"kind": "x"}])
    with pytest.raises(ValueError, match="must end with a user or tool message"):
        messages_from_trace([{"prompt": "q"}, {"response": "a"}])


def test_replay_messages_reads_distinct_successful_prompts(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    with closing(sqlite3.connect(db)) as conn:
        conn.execute(
            "CREATE TABLE pgw_calls (messages TEXT, error TEXT, cache_hit INTEGER, created_at REAL)"
        )
        one = json.dumps([{"role": "user", "content": "one"}])
        rows = [
            (one, None, 0, 1.0),
            (one, None, 0, 2.0),  # a duplicate
            (json.dumps([{"role": "user", "content": "failed"}]), "TransientError", 0, 3.0),
            (json.dumps([{"role": "user", "content": "hit"}]), None, 1, 4.0),
            ("sha256:abc", None, 0, 5.0),  # a digest
            (json.dumps([{"role": "user", "content": "two"}]), None, 0, 6.0),
        ]
        conn.executemany("INSERT INTO pgw_calls VALUES (?, ?, ?, ?)", rows)
        conn.commit()
    assert replay_messages(str(db)) == [
        [{"role": "user", "content": "one"}],
        [{"role": "user", "content": "two"}],
    ]
    assert len(replay_messages(str(db), limit=1)) == 1
    with pytest.raises(ValueError, match="limit"):
        replay_messages(str(db), limit=0)


def test_distinct_prompts_skips_what_is_not_a_message_list() -> None:
    columns = ["[]", "{}", "not json", json.dumps(["x"]), json.dumps([{"prompt": "p"}])]
    assert distinct_prompts(columns, limit=10) == [[{"role": "user", "content": "p"}]]


def test_with_tag_never_changes_the_callers_messages() -> None:
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    out = with_tag(messages, "w0-1")
    assert out[1]["content"] == "[tag:w0-1] u"
    assert messages[1]["content"] == "u"
    replayed = [{"role": "user", "content": "[tag:w3-9] old prompt"}]
    assert with_tag(replayed, "w0-2") == [{"role": "user", "content": "[tag:w0-2] old prompt"}]
    with pytest.raises(ValueError, match="no user message"):
        with_tag([{"role": "system", "content": "s"}], "w0-1")


def test_every_call_is_tagged_with_its_worker() -> None:
    for scenario in ("P1", "P2", "P3", "P4", "P5", "P6"):
        for spec in itertools.islice(calls(scenario, "w2", 1), 200):
            assert spec.tag.startswith("w2-")
            texts = [m["content"] for m in spec.messages] + list(spec.texts)
            if spec.kind != "ocr":
                assert any(tag_of(t) == spec.tag for t in texts), spec


def test_scenarios_are_reproducible_per_seed_and_worker() -> None:
    first = list(itertools.islice(calls("P6", "w0", 7), 300))
    assert first == list(itertools.islice(calls("P6", "w0", 7), 300))
    assert first != list(itertools.islice(calls("P6", "w1", 7), 300))


def test_p6_follows_the_mix_and_the_ocr_share() -> None:
    specs = list(itertools.islice(calls("P6", "w0", 3, ocr_every=20), 20000))
    counts = Counter(s.scenario for s in specs)
    assert counts["OCR"] == 1000
    others = len(specs) - counts["OCR"]
    share = {name: weight / 100 for name, weight in P6_WEIGHTS}
    assert abs(counts["P1"] / others - share["P1"]) < 0.02
    assert abs(counts["P2"] / others - share["P2"]) < 0.02
    assert abs((counts["P3"] + counts["P4"]) / others - share["P3"]) < 0.02
    assert abs(counts["P5"] / others - share["P5"]) < 0.02
    # 3 in 10 structured calls are the repeated (P4) share.
    assert abs(counts["P4"] / (counts["P3"] + counts["P4"]) - 0.3) < 0.03
    assert not any(
        s.kind == "ocr" for s in itertools.islice(calls("P6", "w0", 3, ocr_every=0), 500)
    )


def test_p4_repeats_a_small_pool_across_two_tenants() -> None:
    specs = list(itertools.islice(calls("P4", "w0", 1), 400))
    assert all(s.repeat and s.structured for s in specs)
    assert len({s.tag for s in specs}) <= 12
    assert {s.tenant for s in specs} == {"A", "B"}
    # The same tag always carries the same prompt (so the cache can hit).
    prompts: dict[str, str] = {}
    for s in specs:
        assert prompts.setdefault(s.tag, s.messages[0]["content"]) == s.messages[0]["content"]


def test_p1_replays_recorded_prompts_with_their_own_tags() -> None:
    replay = [[{"role": "system", "content": "s"}, {"role": "user", "content": "recorded"}]]
    specs = list(itertools.islice(calls("P1", "w0", 1, replay=replay), 5))
    assert [s.messages[1]["content"] for s in specs] == [
        f"[tag:w0-{n}] recorded" for n in range(1, 6)
    ]
    assert replay[0][1]["content"] == "recorded"


def test_p2_uses_client_stream_for_half_its_calls() -> None:
    kinds = Counter(s.kind for s in itertools.islice(calls("P2", "w0", 1), 100))
    assert kinds == {"stream": 50, "chat": 50}


def test_unknown_scenario_and_bad_ocr_share_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown scenario 'P9'"):
        next(calls("P9", "w0", 1))
    with pytest.raises(ValueError, match="ocr_every"):
        next(calls("P6", "w0", 1, ocr_every=-1))
