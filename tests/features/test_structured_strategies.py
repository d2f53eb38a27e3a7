"""JsonRepairStrategy and NativeSchemaStrategy: rungs ①-③ of the ladder, without network."""

from __future__ import annotations

from typing import Any

import pytest
from polygateway.errors import ResultInvalidError
from polygateway.ports import ProviderProfile
from polygateway.structured.json_repair import JsonRepairStrategy, strip_fences
from polygateway.structured.native_schema import NativeSchemaStrategy, schema_name
from polygateway.types import ChatRequest
from pydantic import BaseModel


class Invoice(BaseModel):
    number: str
    total: int


class Weird_Name_Ä_With_Spaces_And_A_Very_Long_Name_That_Goes_On_And_On_Forever_X(BaseModel):
    x: int


REQUEST = ChatRequest(messages=[{"role": "user", "content": "invoice?"}])
NATIVE = ProviderProfile(name="native", supports_native_schema=True)
PLAIN = ProviderProfile(name="plain")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"a": 1}', {"a": 1}),
        ("  [1, 2]\n", [1, 2]),
        ('```json\n{"a": 1}\n```', {"a": 1}),
        ('```\n{"a": 1}\n```', {"a": 1}),
        ('Here you go:\n```JSON\n{"a": [1, 2]}\n```\nAnything else?', {"a": [1, 2]}),
        ('```json\n{"a": 1', {"a": 1}),  # unterminated fence and object
        ('Sure! {"a": 1} Hope that helps.', {"a": 1}),
        ('{"a": 1} and also {"b": 2}', {"a": 1}),  # the first value wins
        ('{"a": 1,}', {"a": 1}),
        ("{'a': 'single quotes'}", {"a": "single quotes"}),
        ('{"a": "unterminated', {"a": "unterminated"}),
        ('<p>{"nested": {"x": [true, null]}}</p>', {"nested": {"x": [True, None]}}),
    ],
)
def test_json_mode_repairs_what_models_write(text: str, expected: Any) -> None:
    assert JsonRepairStrategy().parse(text, "json") == expected


@pytest.mark.parametrize(
    "text", ["", "   ", "no json at all, sorry", "42", '"just a string"', "null", "{", "[}"]
)
def test_hopeless_output_is_a_result_invalid_error(text: str) -> None:
    with pytest.raises(ResultInvalidError) as caught:
        JsonRepairStrategy().parse(text, "json")
    assert caught.value.raw_text == text
    assert caught.value.repair_errors
    assert not caught.value.validation_errors


def test_model_schema_returns_a_validated_instance() -> None:
    parsed = JsonRepairStrategy().parse('```json\n{"number": "A-1", "total": "12"}\n```', Invoice)
    assert parsed == Invoice(number="A-1", total=12)


def test_schema_mismatch_lists_validation_errors() -> None:
    text = '{"number": 7, "total": "lots"}'
    with pytest.raises(ResultInvalidError) as caught:
        JsonRepairStrategy().parse(text, Invoice)
    errors = caught.value.validation_errors
    assert len(errors) == 2
    assert errors[0].startswith("number: Input should be a valid string")
    assert errors[1].startswith("total: Input should be a valid integer")
    assert "(got 'lots')" in errors[1]
    assert caught.value.raw_text == text
    assert not caught.value.repair_errors


def test_missing_field_is_reported_by_location() -> None:
    with pytest.raises(ResultInvalidError) as caught:
        JsonRepairStrategy().parse('{"number": "A"}', Invoice)
    assert caught.value.validation_errors == ("total: Field required",)


def test_normalizer_runs_between_repair_and_validation() -> None:
    seen: list[Any] = []

    def fold(value: Any) -> Any:
        seen.append(value)
        return {"number": value["invoice_number"], "total": value["invoice_total"]}

    strategy = JsonRepairStrategy(normalize=fold)
    parsed = strategy.parse('{"invoice_number": "B", "invoice_total": 3,}', Invoice)
    assert parsed == Invoice(number="B", total=3)
    assert seen == [{"invoice_number": "B", "invoice_total": 3}]


def test_a_failing_normalizer_is_a_repair_error() -> None:
    strategy = JsonRepairStrategy(normalize=lambda value: value["absent"])
    with pytest.raises(ResultInvalidError) as caught:
        strategy.parse('{"a": 1}', "json")
    assert caught.value.repair_errors[0].startswith("normalize failed: KeyError")


@pytest.mark.parametrize("schema", [dict, "yaml", 3, Invoice(number="x", total=1)])
def test_unknown_schema_kinds_are_refused(schema: Any) -> None:
    with pytest.raises(TypeError, match="pydantic BaseModel subclass"):
        JsonRepairStrategy().parse("{}", schema)


def test_repair_strategy_never_changes_the_request() -> None:
    assert JsonRepairStrategy().prepare(REQUEST, Invoice, NATIVE) is REQUEST


def test_strip_fences_leaves_plain_text_alone() -> None:
    assert strip_fences('{"a": 1}') == '{"a": 1}'


# --------------------------------------------------------------------------- native schema


def test_native_schema_adds_response_format_when_the_profile_supports_it() -> None:
    prepared = NativeSchemaStrategy().prepare(REQUEST, Invoice, NATIVE)
    assert prepared.response_format == {
        "type": "json_schema",
        "json_schema": {
            "name": "Invoice",
            "schema": Invoice.model_json_schema(),
            "strict": False,
        },
    }
    assert prepared.messages is REQUEST.messages
    assert REQUEST.response_format is None


@pytest.mark.parametrize(
    ("profile", "schema"), [(PLAIN, Invoice), (None, Invoice), (NATIVE, "json")]
)
def test_native_schema_leaves_other_requests_alone(
    profile: ProviderProfile | None, schema: Any
) -> None:
    assert NativeSchemaStrategy().prepare(REQUEST, schema, profile) is REQUEST


def test_schema_names_are_sanitised_for_the_api() -> None:
    name = schema_name(Weird_Name_Ä_With_Spaces_And_A_Very_Long_Name_That_Goes_On_And_On_Forever_X)
    assert len(name) == 64
    assert all(c.isascii() and (c.isalnum() or c in "_-") for c in name)
    assert name.startswith("Weird_Name___With")


def test_native_schema_parses_like_the_repair_strategy() -> None:
    strategy = NativeSchemaStrategy(normalize=lambda v: {**v, "total": v["total"] * 2})
    assert strategy.parse('```json\n{"number": "C", "total": 2}\n```', Invoice) == Invoice(
        number="C", total=4
    )
