"""The script client's own RESP packing against redis-py's, on any keys and arguments."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from pgw_redis.connection import _MEMO_MAX, EncodedInts, PackedCall, ScriptCall, _pack, bulk
from pgw_redis.scripts import LuaScript
from redis.connection import Connection

SCRIPT = LuaScript("probe", "return 1")
texts = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=12)


@settings(max_examples=300, deadline=None)
@given(
    calls=st.lists(
        st.tuples(
            st.lists(st.sampled_from(["pgw:a", "pgw:{LLM}:b", "é"]) | texts, max_size=6),
            st.lists(st.integers(-(2**63), 2**63 - 1) | texts, max_size=12),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_pack_is_redis_pys_command(calls: list[tuple[list[str], list[str | int]]]) -> None:
    memo: dict[str | int, bytes] = {}  # shared across calls, as a client's is
    for keys, args in calls:
        expected = b"".join(
            Connection().pack_command("EVALSHA", SCRIPT.sha, len(keys), *keys, *args)
        )
        assert _pack(ScriptCall(SCRIPT, keys, args), memo) == expected


@settings(max_examples=300, deadline=None)
@given(
    keys=st.lists(st.sampled_from(["pgw:a", "pgw:{LLM}:b", "é"]) | texts, max_size=6),
    args=st.lists(st.integers(-(2**63), 2**63 - 1) | texts, max_size=12),
)
def test_a_packed_call_is_redis_pys_command_and_decodes_back(
    keys: list[str], args: list[str | int]
) -> None:
    call = PackedCall(
        SCRIPT,
        len(keys),
        b"".join(bulk(key) for key in keys),
        len(args),
        b"".join(bulk(arg) for arg in args),
    )
    expected = b"".join(Connection().pack_command("EVALSHA", SCRIPT.sha, len(keys), *keys, *args))
    assert _pack(call, {}) == expected
    # What the Cluster pipeline is given instead.
    assert call.keys == [key.encode() for key in keys]
    assert call.args == [str(arg).encode() for arg in args]


@settings(max_examples=300, deadline=None)
@given(values=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=40))
def test_encoded_ints_are_bulk_strings(values: list[int]) -> None:
    encoded = EncodedInts()
    for value in values * 2:  # the second time from the memo
        packed = b"".join(Connection().pack_command("ECHO", value))
        assert packed == b"*2\r\n$4\r\nECHO\r\n" + encoded[value]


def test_encoded_ints_hold_a_bounded_number() -> None:
    encoded = EncodedInts()
    for value in range(3 * _MEMO_MAX):
        assert encoded[value] == bulk(value)
        assert len(encoded) <= _MEMO_MAX
