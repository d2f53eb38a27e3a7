"""PricingTable: cost formula, unknown models, and file errors that fail loudly."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from polygateway.errors import ConfigError
from polygateway.telemetry.pricing import PricingTable

PRICES = {
    "model-a": {"input_per_1m": 2.0, "output_per_1m": 8.0},
    "free": {"input_per_1m": 0, "output_per_1m": 0},
}


def test_cost_is_prompt_and_completion_per_million() -> None:
    table = PricingTable(PRICES)
    assert table.cost("model-a", 1_000_000, 0) == pytest.approx(2.0)
    assert table.cost("model-a", 0, 1_000_000) == pytest.approx(8.0)
    assert table.cost("model-a", 1500, 500) == pytest.approx(1500 / 1e6 * 2 + 500 / 1e6 * 8)
    assert table.cost("free", 10, 10) == 0.0


def test_cached_and_cache_written_tokens_are_priced_at_their_own_rates() -> None:
    table = PricingTable(
        {
            "cached": {
                "input_per_1m": 3.0,
                "output_per_1m": 15.0,
                "cached_input_per_1m": 0.3,
                "cache_write_per_1m": 3.75,
            },
            "plain": {"input_per_1m": 2.0, "output_per_1m": 8.0},
        }
    )
    # 1000 prompt tokens of which 600 read from the cache and 300 written to it: each part
    # at its own rate, never at the input rate as well.
    cost = table.cost("cached", 1000, 10, cached_tokens=600, cache_write_tokens=300)
    assert cost == pytest.approx((100 * 3.0 + 600 * 0.3 + 300 * 3.75 + 10 * 15.0) / 1e6)
    # Without cache rates the cache parts cost the input rate (the old formula).
    assert table.cost("plain", 1000, 10, cached_tokens=600) == table.cost("plain", 1000, 10)


def test_unknown_model_costs_none_and_warns_once_per_model(
    caplog: pytest.LogCaptureFixture,
) -> None:
    table = PricingTable(PRICES)
    with caplog.at_level(logging.WARNING, logger="polygateway.telemetry.pricing"):
        assert table.cost("mystery", 10, 10) is None
        assert table.cost("mystery", 20, 20) is None
        assert table.cost("other", 1, 1) is None
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert "'mystery'" in messages[0] and "'other'" in messages[1]


def test_from_file_loads_a_json_table(tmp_path: Path) -> None:
    path = tmp_path / "prices.json"
    path.write_text(json.dumps(PRICES), encoding="utf-8")
    table = PricingTable.from_file(str(path))
    assert table.models == frozenset(PRICES)
    assert table.cost("model-a", 1_000_000, 1_000_000) == pytest.approx(10.0)


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "absent.json"
    with pytest.raises(ConfigError, match=r"absent\.json.*not found"):
        PricingTable.from_file(str(path))


def test_broken_json_names_the_path_and_position(tmp_path: Path) -> None:
    path = tmp_path / "prices.json"
    path.write_text('{"model-a": {"input_per_1m": 2,,}}', encoding="utf-8")
    with pytest.raises(ConfigError, match=r"prices.json: invalid JSON at line 1 column"):
        PricingTable.from_file(str(path))


def test_top_level_must_be_an_object(tmp_path: Path) -> None:
    path = tmp_path / "prices.json"
    path.write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(ConfigError, match="expected a JSON object"):
        PricingTable.from_file(str(path))


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ({"input_per_1m": 1}, "model 'm': missing field 'output_per_1m'"),
        ({"input_per_1m": -1, "output_per_1m": 1}, "field 'input_per_1m' must be a finite"),
        ({"input_per_1m": "1", "output_per_1m": 1}, "field 'input_per_1m' must be a finite"),
        ({"input_per_1m": True, "output_per_1m": 1}, "field 'input_per_1m' must be a finite"),
        ({"input_per_1m": 1, "output_per_1m": float("inf")}, "'output_per_1m' must be a finite"),
        ({"input_per_1m": 1, "output_per_1m": 1, "input_per_1M": 1}, "unknown field"),
        (
            {"input_per_1m": 1, "output_per_1m": 1, "cached_input_per_1m": -0.1},
            "field 'cached_input_per_1m' must be a finite",
        ),
        (
            {"input_per_1m": 1, "output_per_1m": 1, "cache_write_per_1m": "x"},
            "field 'cache_write_per_1m' must be a finite",
        ),
        (3.5, "model 'm': expected"),
    ],
)
def test_bad_entries_name_the_file_model_and_field(
    tmp_path: Path, entry: Any, expected: str
) -> None:
    path = tmp_path / "prices.json"
    path.write_text(json.dumps({"m": entry}), encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        PricingTable.from_file(str(path))
    assert str(path) in str(caught.value)
    assert expected in str(caught.value)


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(ConfigError) as caught:
        PricingTable({"a": {"input_per_1m": 1}, "b": {"output_per_1m": -2}})
    assert len(caught.value.problems) == 3
