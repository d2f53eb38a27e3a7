"""``frozen_dataclass``: a class it makes is the class ``@value_methods`` over
``@dataclass(frozen=True, repr=False, eq=False)`` makes (the definition), field for field, guard
for guard: for the per-call classes of the core, and for twin classes made both ways."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import pickle
from collections.abc import Callable
from typing import Any

import pytest
from polygateway.frozen import frozen_dataclass, value_methods
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
def test_the_init_makes_what_the_dataclass_init_makes(
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


def test_the_classes_with_a_dict_write_it_at_once() -> None:
    for cls, args, kwargs in CASES:
        cls(*args, **kwargs)  # the first instance compiles the class's own __init__
        assert cls.__init__.__qualname__ == f"{cls.__qualname__}.__init__"
        assert "__values__" in cls.__init__.__code__.co_varnames, cls


def test_a_default_factory_gives_each_instance_its_own_value() -> None:
    first, second = ChatRequest([]), ChatRequest([])
    assert first.extra_body == {} and first.extra_body is not second.extra_body


def test_a_generic_alias_call_still_works() -> None:
    assert LLMResponse[int](content="a", structured_data=1).structured_data == 1


def test_post_init_runs_and_a_str_key_becomes_a_secret() -> None:
    source = SourceConfig(name="a", provider="openai", model="m", base_url="http://x", api_key="k")
    assert source.api_key.reveal() == "k" and repr(source.api_key) == "Secret('***')"
    with pytest.raises(TypeError, match="api_key must be"):
        SourceConfig(name="a", provider="openai", model="m", base_url="http://x", api_key=1)  # type: ignore[arg-type]


_TOY = """
@DECORATOR
class Toy:
    DOC
    name: str
    size: int = 3
    tags: list[str] = dataclasses.field(default_factory=list)
    note: str | None = dataclasses.field(default=None, compare=False)
    secret: str = dataclasses.field(default="s", repr=False)
    kind: typing.ClassVar[str] = "toy"
POST_INIT
"""


def _run(source: str, namespace: dict[str, Any]) -> None:
    # Without this module's ``from __future__ import annotations``: an ``InitVar`` annotation
    # must be a real one for the dataclass to see it.
    exec(compile(source, "<toy>", "exec", dont_inherit=True), namespace)


def _toy(*, made_here: bool, slots: bool, documented: bool = True, post_init: bool = False) -> Any:
    decorator = (
        f"frozen_dataclass(slots={slots})"
        if made_here
        else "value_methods\n"
        f"@dataclasses.dataclass(frozen=True, slots={slots}, repr=False, eq=False)"
    )
    source = (
        _TOY.replace("DECORATOR", decorator)
        .replace("DOC", '"""A toy."""' if documented else "")
        .replace(
            "POST_INIT",
            "    def __post_init__(self):\n"
            "        object.__setattr__(self, 'size', self.size * 2)\n"
            if post_init
            else "",
        )
    )
    namespace: dict[str, Any] = {
        "dataclasses": dataclasses,
        "typing": __import__("typing"),
        "frozen_dataclass": frozen_dataclass,
        "value_methods": value_methods,
    }
    _run(source, namespace)
    return namespace["Toy"]


def _twins(slots: bool, **options: bool) -> tuple[Any, Any]:
    """The definition's class and ``frozen_dataclass``'s, from the same source."""
    return (
        _toy(made_here=False, slots=slots, **options),
        _toy(made_here=True, slots=slots, **options),
    )


def _state(obj: object) -> list[tuple[str, Any]]:
    return [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]  # type: ignore[arg-type]


def _outcome(action: Callable[..., Any], *args: Any) -> tuple[str, str]:
    try:
        action(*args)
    except Exception as exc:  # the exception's class and text are what is compared
        return type(exc).__name__, str(exc)
    return "ok", ""


@pytest.mark.parametrize("slots", [False, True])
def test_the_class_is_the_frozen_dataclass(slots: bool) -> None:
    plain, made = _twins(slots)
    for name in ("init", "repr", "eq", "order", "unsafe_hash", "frozen"):
        assert getattr(made.__dataclass_params__, name) is getattr(
            plain.__dataclass_params__, name
        ), name
    assert [f.name for f in dataclasses.fields(made)] == [f.name for f in dataclasses.fields(plain)]
    assert made.__match_args__ == plain.__match_args__
    assert ("__slots__" in vars(made)) is slots and getattr(made, "__slots__", None) == getattr(
        plain, "__slots__", None
    )
    assert made.__doc__ == plain.__doc__ == "A toy."
    for method in ("__init__", "__setattr__", "__delattr__", "__repr__", "__eq__", "__hash__"):
        assert getattr(made, method).__qualname__ == f"Toy.{method}", method
    assert dataclasses.is_dataclass(made) and made.kind == "toy"


@pytest.mark.parametrize("slots", [False, True])
def test_the_signature_and_argument_errors_are_the_dataclass_ones(slots: bool) -> None:
    plain, made = _twins(slots)
    plain_params = list(inspect.signature(plain).parameters.values())
    made_params = list(inspect.signature(made).parameters.values())
    assert [(p.name, p.kind, p.annotation) for p in made_params] == [
        (p.name, p.kind, p.annotation) for p in plain_params
    ]
    assert [repr(p.default) for p in made_params] == [repr(p.default) for p in plain_params]
    assert made.__init__.__annotations__ == plain.__init__.__annotations__
    calls: list[Callable[[type], Any]] = [
        lambda cls: cls(),
        lambda cls: cls("a", 1, [], "n", "s", "extra"),
        lambda cls: cls("a", colour="red"),
        lambda cls: cls("a", name="b"),
    ]
    for call in calls:
        assert _outcome(call, made) == _outcome(call, plain)
        assert _outcome(call, made)[0] == "TypeError"


@pytest.mark.parametrize("slots", [False, True])
def test_instances_hold_the_same_values_and_compare_the_same(slots: bool) -> None:
    plain, made = _twins(slots)
    argument_sets: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        (("a",), {}),
        (("a", 5, ["x"]), {"note": "n"}),
        (("b",), {"secret": "other", "size": 7}),
    ]
    for args, kwargs in argument_sets:
        p, m = plain(*args, **kwargs), made(*args, **kwargs)
        assert _state(m) == _state(p)
        assert repr(m) == repr(p)
        assert _outcome(hash, m) == _outcome(hash, p)  # a list field: unhashable
        assert m == made(*args, **kwargs) and m != made("other")
        if not slots:
            assert list(vars(m).items()) == list(vars(p).items())
    assert made("a").tags == [] and made("a").tags is not made("a").tags


@pytest.mark.parametrize("slots", [False, True])
def test_the_frozen_guards_do_what_the_generated_ones_do(slots: bool) -> None:
    plain, made = _twins(slots)
    actions: list[Callable[[Any], Any]] = [
        lambda obj: setattr(obj, "name", "x"),
        lambda obj: setattr(obj, "unknown", 1),
        lambda obj: delattr(obj, "size"),
        lambda obj: delattr(obj, "unknown"),
    ]
    for action in actions:
        outcome = _outcome(action, made("a"))
        assert outcome == _outcome(action, plain("a"))
        assert outcome[0] != "ok"
    assert _outcome(setattr, made("a"), "name", "x") == (
        "FrozenInstanceError",
        "cannot assign to field 'name'",
    )
    # A subclass that is not a dataclass itself may add attributes, not assign fields.
    plain_sub, made_sub = type("Sub", (plain,), {}), type("Sub", (made,), {})
    for action in actions:
        assert _outcome(action, made_sub("a")) == _outcome(action, plain_sub("a"))


@pytest.mark.parametrize("slots", [False, True])
def test_pickle_copy_and_replace_give_the_same_values(slots: bool) -> None:
    _, made = _twins(slots)
    globals()["Toy"] = made  # pickle finds a class by its module and name
    made.__module__ = __name__
    try:
        obj = made("a", 5, ["x"], "n", "hidden")
        for again in (pickle.loads(pickle.dumps(obj)), copy.copy(obj), copy.deepcopy(obj)):
            assert type(again) is made and _state(again) == _state(obj)
        assert _state(dataclasses.replace(obj, size=9))[1] == ("size", 9)
    finally:
        del globals()["Toy"]


@pytest.mark.parametrize("slots", [False, True])
def test_the_init_is_compiled_at_the_first_instance_and_shows_its_signature_before(
    slots: bool,
) -> None:
    plain, made = _twins(slots)
    deferred = made.__init__
    before = inspect.signature(made)
    assert str(before) == str(inspect.signature(plain))
    assert made.__init__.__qualname__ == "Toy.__init__" and made.__module__ == plain.__module__
    sub = type("Sub", (made,), {})
    assert _state(sub("a", 5)) == _state(plain("a", 5))  # a subclass's first instance
    assert made.__init__ is not deferred and "name" in made.__init__.__code__.co_varnames
    assert sub.__init__ is made.__init__  # handed over on the class that defines it
    assert str(inspect.signature(made)) == str(before)
    assert _state(made("b")) == _state(plain("b"))


def test_post_init_and_an_undocumented_class_are_the_dataclass_ones() -> None:
    for slots in (False, True):
        plain, made = _twins(slots, documented=False, post_init=True)
        assert made.__doc__ == plain.__doc__ and made.__doc__.startswith("Toy(name: str")
        assert made("a").size == plain("a").size == 6


@pytest.mark.parametrize(
    "source",
    [
        "@dataclasses.dataclass(frozen=True)\nclass Base:\n    a: int\n"
        "@frozen_dataclass\nclass C(Base):\n    b: int = 0\n",
        "@frozen_dataclass\nclass C:\n    a: int\n"
        "    b: int = dataclasses.field(default=0, init=False)\n",
        "@frozen_dataclass\nclass C:\n    a: int = dataclasses.field(kw_only=True)\n",
        "@frozen_dataclass\nclass C:\n    a: int\n    b: dataclasses.InitVar[int]\n",
        "@frozen_dataclass\nclass C:\n    self: int\n",
        "@frozen_dataclass\nclass C:\n    __set__: int\n",
        "@frozen_dataclass\nclass C:\n    a: int\n    def __setattr__(self, name, value): pass\n",
    ],
    ids=["dataclass-base", "init-false", "kw-only", "initvar", "self", "dunder", "own-setattr"],
)
def test_what_it_does_not_make_the_dataclass_way_is_refused(source: str) -> None:
    namespace: dict[str, Any] = {"dataclasses": dataclasses, "frozen_dataclass": frozen_dataclass}
    with pytest.raises(TypeError, match=r"frozen_dataclass|Cannot overwrite"):
        _run(source, namespace)
