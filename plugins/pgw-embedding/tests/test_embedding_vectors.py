"""Decoding, ordering and shape checks of embedding answers; input checks and batching."""

from __future__ import annotations

import math
from typing import Any

import pytest
from pgw_embedding.inputs import (
    check_texts,
    estimate_tokens,
    max_input_chars,
    option_int,
    split_batches,
)
from pgw_embedding.vectors import (
    NORM_FLOOR,
    check_dimension,
    decode_base64_floats,
    l2_normalize,
    vectors_from_data,
)
from pgw_embedding_test_helpers import b64_floats, embed_source
from polygateway.errors import ConfigError, RequestRejectedError, ResultInvalidError


def item(index: Any, embedding: Any) -> dict[str, Any]:
    return {"object": "embedding", "index": index, "embedding": embedding}


def test_base64_is_little_endian_float32() -> None:
    # 0.0, 0.5, 1.0 as little-endian float32 (the example of protocols.md §3).
    assert decode_base64_floats("AAAAAAAAAD8AAIA/") == [0.0, 0.5, 1.0]
    assert decode_base64_floats(b64_floats([1.5, -2.25])) == [1.5, -2.25]
    # The largest finite float32 values (exponent bits almost all ones) are accepted.
    big = [3.4028234663852886e38, -(2.0**127), 2.0**-149]
    assert decode_base64_floats(b64_floats(big)) == big


def test_data_is_sorted_by_index_and_mixed_encodings_are_accepted() -> None:
    data = [item(2, [0.0, 3.0]), item(0, b64_floats([1.0, 0.0])), item(1, [0, 2])]
    vectors, dim = vectors_from_data(data, 3)
    assert vectors == [[1.0, 0.0], [0.0, 2.0], [0.0, 3.0]]
    assert dim == 2
    assert all(type(x) is float for v in vectors for x in v)


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ([], "empty data for 2 texts"),
        (None, "no data list"),
        ({"0": [1.0]}, "no data list"),
        ([item(0, [1.0])], "1 vectors for 2 texts"),
        ([item(0, [1.0]), item(0, [2.0])], "index 0 twice"),
        ([item(0, [1.0]), item(2, [2.0])], "no valid index"),
        ([item(0, [1.0]), item(True, [2.0])], "no valid index"),
        ([item(0, [1.0]), "vector"], "no valid index"),
        ([item(0, [1.0]), item(1, [1.0, 2.0])], "mixed length"),
        ([item(0, []), item(1, [])], "empty vector"),
        ([item(0, [1.0]), item(1, ["x"])], "neither a list of numbers"),
        ([item(0, [1.0]), item(1, {"v": 1})], "neither a list of numbers"),
        ([item(0, [1.0]), item(1, "!!not base64!!")], "not valid base64"),
        ([item(0, [1.0]), item(1, "AAAA AA==")], "not valid base64"),
        ([item(0, [1.0]), item(1, "AAA=")], "not a whole number of float32"),
        ([item(0, [1.0]), item(1, [math.nan])], "not finite"),
        ([item(0, [1.0]), item(1, b64_floats([math.inf]))], "not finite"),
        ([item(0, [1.0]), item(1, b64_floats([0.5, -math.inf]))], "not finite"),
        ([item(0, [1.0]), item(1, b64_floats([0.5, math.nan, 0.5]))], "not finite"),
        ([item(0, [1.0]), item(1, [1e308, 1e308])], "not finite"),
    ],
)
def test_unusable_answers_are_result_invalid(data: Any, needle: str) -> None:
    with pytest.raises(ResultInvalidError, match=needle):
        vectors_from_data(data, 2, source_name="s1")


def test_l2_normalize_and_its_floor() -> None:
    [unit, zero] = l2_normalize([[3.0, 4.0], [0.0, 0.0]])
    assert unit == [0.6, 0.8]
    assert zero == [0.0, 0.0]  # divided by NORM_FLOOR, not by zero
    [tiny] = l2_normalize([[1e-13, 0.0]])
    assert tiny == [1e-13 / NORM_FLOOR, 0.0]


def test_check_dimension() -> None:
    check_dimension(8, None)
    check_dimension(8, 8)
    with pytest.raises(ResultInvalidError, match="dimension 8, expected 16"):
        check_dimension(8, 16, source_name="s1")


def test_check_texts() -> None:
    texts = ["a", "bb"]
    assert check_texts(texts) is texts
    assert check_texts([]) == []
    with pytest.raises(RequestRejectedError, match=r"got str \(wrap a single text"):
        check_texts("hello")
    with pytest.raises(RequestRejectedError, match="got tuple"):
        check_texts(("a", "b"))
    with pytest.raises(RequestRejectedError, match=r"texts\[1\] must be a string, got int"):
        check_texts(["a", 3])
    with pytest.raises(RequestRejectedError, match=r"texts\[2\] is an empty string"):
        check_texts(["a", "b", ""])
    with pytest.raises(RequestRejectedError, match=r"texts\[1\] has 4 characters.*'s2'"):
        check_texts(["abc", "abcd"], (3, "s2"))


def test_max_input_chars_is_the_smallest_declared() -> None:
    sources = [
        embed_source(None, "s1", base_url="http://x/v1"),
        embed_source(None, "s2", base_url="http://x/v1", options={"max_input_chars": "300"}),
        embed_source(None, "s3", base_url="http://x/v1", options={"max_input_chars": 200}),
    ]
    assert max_input_chars(sources) == (200, "s3")
    assert max_input_chars(sources[:1]) is None
    with pytest.raises(ConfigError, match="'max_input_chars' must be an integer >= 1"):
        option_int({"max_input_chars": -1}, "max_input_chars", "s1")


def test_split_batches_keeps_order() -> None:
    texts = [str(i) for i in range(7)]
    assert split_batches(texts, 3) == [["0", "1", "2"], ["3", "4", "5"], ["6"]]
    assert split_batches(texts, 100) == [texts]
    assert split_batches([], 3) == []
    with pytest.raises(ConfigError, match="batch_size"):
        split_batches(texts, 0)


def test_estimate_tokens() -> None:
    assert estimate_tokens(["abcd", "abcde"]) == 3  # 9 characters / 4, rounded up
    assert estimate_tokens(["a"]) == 1
