"""Call ids: UUIDv7 form (time first), unique, ordered by time, and never shared between a
process and its forked child."""

from __future__ import annotations

import os
import random
import sys
import time
import uuid

import pytest
from polygateway.ids import new_call_id


def test_call_ids_are_uuid7_hex_and_unique() -> None:
    ids = []
    for _ in range(1_000):
        random.seed(42)  # a seeded ``random`` module must not repeat ids
        ids.extend(new_call_id() for _ in range(10))
    assert len(set(ids)) == len(ids)
    for call_id in ids[:500]:
        parsed = uuid.UUID(call_id)
        assert parsed.hex == call_id
        assert parsed.version == 7
        assert parsed.variant == uuid.RFC_4122


def test_call_ids_carry_their_time_and_sort_by_it() -> None:
    before_ms = time.time_ns() // 1_000_000
    first = new_call_id()
    after_ms = time.time_ns() // 1_000_000
    assert before_ms <= int(first[:12], 16) <= after_ms
    # Made in a later millisecond, an id sorts after: the telemetry key grows at its end.
    while time.time_ns() // 1_000_000 <= after_ms:
        pass
    assert new_call_id() > first


@pytest.mark.skipif(sys.platform == "win32", reason="needs fork")
def test_a_forked_child_does_not_repeat_the_parents_ids() -> None:
    read_end, write_end = os.pipe()
    # Both seed ``random`` alike (as a user's code may): the ids must still differ.
    random.seed(42)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        random.seed(42)
        os.write(write_end, "".join(new_call_id() for _ in range(4)).encode())
        os._exit(0)
    os.close(write_end)
    os.waitpid(pid, 0)
    with os.fdopen(read_end, "rb") as pipe:
        child = pipe.read().decode()
    random.seed(42)
    parent = "".join(new_call_id() for _ in range(4))
    assert len(child) == len(parent) == 128
    assert child != parent
