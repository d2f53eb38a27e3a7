"""``fast_frozen_init``: the per-call frozen dataclasses' ``__init__`` builds what the dataclass's
own ``__init__`` builds (the definition), for every class that carries it."""

from __future__ import annotations

import dataclasses
import inspect
import pickle
from collections.abc import Callable
from typing import Any

import pytest
from polygateway.frozen import fast_frozen_init
from polygateway.governance.attempts import Outcome
from polygateway.ports import Denial, GateDecision, GateUpdate
from polygateway.settings import SourceConfig
from polygateway.types import (
    CallStart,
    ChatRequest,
    GovernanceEvent,
    LLMResponse,
    TelemetryRecord,
    ToolCall,
    TransportResult,
)


def definition(cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What the dataclass's own frozen ``__init__`` does: each field by ``object.__setattr__``,
    from the arguments, else its default, else its default factory."""
    made = object.__new__(cls)
    given = dict(zip([f.name for f in dataclasses.fields(cls)], args, strict=False)) | kwargs
    for field in dataclasses.fields(cls):
        if field.name in given:
            value = given[field.name]
        elif field.default is not dataclasses.MISSING:
            value = field.default
        else:
            value = field.default_factory()  # type: ignore[misc]
        object.__setattr__(made, field.name, value)
    return made


SOURCE = SourceConfig(name="main", provider="openai", model="gpt-x", base_url="http://x/v1")

CASES: list[tuple[type, tuple[Any, ...], dict[str, Any]]] = [
    (LLMResponse, ("hi",), {}),
    (
        LLMResponse,
        ("hi", "think", "m", "p", 3, 4, 5, 1.5, 2.5, True, "c", "s", 0.1, "estimated", {"a": 1}),
        {"finish_reason": "stop", "tool_calls": (ToolCall("t1", "f", "{}"),)},
    ),
    (TransportResult, ("hi",), {"prompt_tokens": 7, "salvaged": True}),
    (ChatRequest, ([{"role": "user", "content": "hi"}],), {}),
    (ChatRequest, ([],), {"extra_body": {"seed": 1}, "stream": False, "deadline_s": 3.0}),
    (
        TelemetryRecord,
        ("c1", None, "s1", "m", "p", "main", "[]", "hi", "", 1, 2, "measured", 5, None, None),
        {"cache_hit": False, "error": None, "cost": 0.1, "created_at": 1.0},
    ),
    (GovernanceEvent, ("limiter_refused",), {"source": "main", "gate": "rpm", "wait_s": 0.5}),
    (CallStart, ("chat", 1.0), {"stream": True}),
    (Outcome, ("value", SOURCE, "c1", 2), {}),
    (Denial, ("global_rpm", 1.5), {}),
    (GateDecision, ("main", True, "half_open", 3), {"probe_owner": "p1"}),
    (GateUpdate, ("main", True, "closed", 3, 0), {}),
]


@pytest.mark.parametrize(("cls", "args", "kwargs"), CASES, ids=lambda c: getattr(c, "__name__", ""))
def test_the_fast_frozen_init_makes_what_the_dataclass_init_makes(
    cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    made, expected = cls(*args, **kwargs), definition(cls, args, kwargs)
    assert type(made) is cls
    assert vars(made) == vars(expected) and list(vars(made)) == list(vars(expected))
    assert made == expected and repr(made) == repr(expected)
    with pytest.raises(dataclasses.FrozenInstanceError):
        object.__getattribute__(made, "__setattr__")(dataclasses.fields(cls)[0].name, "x")
    field = dataclasses.fields(cls)[0].name
    assert getattr(dataclasses.replace(made, **{field: "x"}), field) == "x"
    assert pickle.loads(pickle.dumps(made)) == made


def test_the_decorated_classes_carry_the_fast_frozen_init() -> None:
    for cls, _, _ in CASES:
        assert cls.__init__.__qualname__ == f"{cls.__qualname__}.__init__"
        assert "__values__" in cls.__init__.__code__.co_varnames, cls


def test_a_default_factory_gives_each_instance_its_own_value() -> None:
    first, second = ChatRequest([]), ChatRequest([])
    assert first.extra_body == {} and first.extra_body is not second.extra_body


def test_a_generic_alias_call_still_works() -> None:
    assert LLMResponse[int](content="a", structured_data=1).structured_data == 1


_TOY = """
@dataclasses.dataclass(frozen=True)
class Toy:
    name: str
    size: int = 3
    tags: list[str] = dataclasses.field(default_factory=list)
    note: str | None = dataclasses.field(default=None, compare=False)
"""


def _run(source: str, namespace: dict[str, Any]) -> None:
    # Without this module's ``from __future__ import annotations``: an ``InitVar`` annotation
    # must be a real one for the dataclass to see it.
    exec(compile(source, "<toy>", "exec", dont_inherit=True), namespace)


def _toy(decorate: bool) -> type:
    namespace: dict[str, Any] = {"dataclasses": dataclasses}
    _run(_TOY, namespace)
    toy: type = namespace["Toy"]
    return fast_frozen_init(toy) if decorate else toy


def test_the_signature_and_argument_errors_are_the_dataclass_ones() -> None:
    plain, fast = _toy(False), _toy(True)
    plain_params = list(inspect.signature(plain).parameters.values())
    fast_params = list(inspect.signature(fast).parameters.values())
    assert [(p.name, p.kind) for p in fast_params] == [(p.name, p.kind) for p in plain_params]
    assert [p.default for p in fast_params][:2] == [p.default for p in plain_params][:2]
    assert repr(fast_params[2].default) == "<factory>"
    calls: list[Callable[[type], Any]] = [
        lambda cls: cls(),
        lambda cls: cls("a", 1, [], "n", "extra"),
        lambda cls: cls("a", colour="red"),
        lambda cls: cls("a", name="b"),
    ]
    for call in calls:
        with pytest.raises(TypeError) as plain_error:
            call(plain)
        with pytest.raises(TypeError) as fast_error:
            call(fast)
        assert str(fast_error.value) == str(plain_error.value)
    assert vars(fast("a", tags=["x"])) == vars(plain("a", tags=["x"]))


@pytest.mark.parametrize(
    "source",
    [
        "@dataclasses.dataclass\nclass C:\n    a: int\n",
        "@dataclasses.dataclass(frozen=True, slots=True)\nclass C:\n    a: int\n",
        "@dataclasses.dataclass(frozen=True)\nclass C:\n    a: int\n"
        "    def __post_init__(self) -> None: pass\n",
        "@dataclasses.dataclass(frozen=True)\nclass C:\n    a: int\n"
        "    b: int = dataclasses.field(default=0, init=False)\n",
        "@dataclasses.dataclass(frozen=True, kw_only=True)\nclass C:\n    a: int\n",
        "@dataclasses.dataclass(frozen=True)\nclass C:\n    a: int\n"
        "    b: dataclasses.InitVar[int]\n",
        "@dataclasses.dataclass(frozen=True)\nclass C:\n    self: int\n",
        "@dataclasses.dataclass(frozen=True)\nclass C:\n    __set__: int\n",
        "class C:\n    a: int\n",
    ],
    ids=[
        "not-frozen",
        "slots",
        "post-init",
        "init-false",
        "kw-only",
        "initvar",
        "self",
        "dunder",
        "plain",
    ],
)
def test_a_class_whose_init_does_more_than_assign_is_refused(source: str) -> None:
    namespace: dict[str, Any] = {"dataclasses": dataclasses}
    _run(source, namespace)
    with pytest.raises(TypeError, match="fast_frozen_init"):
        fast_frozen_init(namespace["C"])
