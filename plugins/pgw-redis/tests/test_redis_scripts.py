"""The BATCH script's text: what it writes out in its operations still applies, and its
answers fit the widths it writes. (Its behaviour: ``test_redis_batch_equivalence.py``.)"""

from __future__ import annotations

import re

import pytest
from pgw_redis.scripts import _INLINED, BATCH, BATCH_OPERATIONS, BATCH_REPLY_FIELDS, shifted


@pytest.mark.parametrize("rewrite", _INLINED, ids=lambda rewrite: rewrite[0].pattern[:40])
def test_every_written_out_helper_is_found_in_the_operations(
    rewrite: tuple[re.Pattern[str], str],
) -> None:
    # A rewrite that finds nothing (a body edited since) would cost speed silently.
    pattern = rewrite[0]
    assert any(pattern.search(shifted(body)) for body in BATCH_OPERATIONS.values())


def test_the_operations_call_no_helper_that_is_written_out() -> None:
    text = BATCH.source[BATCH.source.index("local function acquire(K, A)") :]
    assert "return {" not in text.split("local function gate_acquire")[0]
    for written_out in ("counter_add(KEYS[K", "\nleases_pruned(KEYS", "local now, sec = now_ms()"):
        assert written_out not in text


def test_every_answer_has_a_width_the_batch_writes() -> None:
    # run_all copies an operation's values into the reply in groups of 1, 3, 6 and 9.
    assert set(BATCH_REPLY_FIELDS.values()) <= {1, 3, 6, 9}
