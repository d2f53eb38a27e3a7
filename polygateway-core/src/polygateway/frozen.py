"""Cheaper dataclass machinery for the project's own dataclasses, same objects.

Python 3.11 compiles every method ``@dataclass`` generates with an ``exec`` of its own (about
0.6-0.9 M instructions each), and a default client defines some sixty dataclasses at start-up.

``value_methods``: the ``__repr__``, ``__eq__`` and ``__hash__`` that ``@dataclass`` generates,
made as closures instead of compiled source text (they were about 90 M of the start-up's
instructions; ``tools/bench/RESULTS.md``, section "start-up"). The results are the generated
methods' (same fields, same order, same tuples hashed, ``NotImplemented`` for another class,
``...`` for a recursive repr).

``frozen_dataclass``: ``@value_methods`` over ``@dataclass(frozen=True, repr=False, eq=False)``
(``slots`` as asked), with one compiled method instead of three: the frozen ``__setattr__`` and
``__delattr__`` are closures doing what the generated ones do (another 70 M at start-up), and
only ``__init__`` is compiled, when the class's first instance is made (a class that is defined
and never instantiated, as most are at start-up, compiles nothing; until then its ``__init__``
shows the same signature). The dataclass underneath is made with ``frozen=False`` and
``init=False`` (nothing compiled), then gets the frozen parts: ``__dataclass_params__.frozen``,
the two guards, and for ``slots`` the ``__getstate__`` and ``__setstate__`` that pickle it.

Its ``__init__`` takes the dataclass's parameters (names, order, defaults, default factories)
and calls ``__post_init__`` when the class has one. A slotted class's sets each field with
``object.__setattr__``, as the dataclass's own does. A class with a ``__dict__`` gets its
fields stored into a new dict made its ``__dict__`` at once: on Python 3.11 the generated
``object.__setattr__`` per field costs about 1,300 instructions (31k for the 20 fields of
``LLMResponse``, and a governed call makes several such objects), this 11.7k for 20 fields,
the same object (equal fields in field order, same repr, hash, pickling and frozenness).
Storing into ``self.__dict__`` (the class's shared-key dict) would be cheaper to build (8.7k),
but attribute reads of a split dict are not specialised on 3.11 (380 instructions a read
against 112), and these objects are read 20 to 80 times a call. A dict display of more than
15 pairs is no faster: it grows one ``MAP_ADD`` at a time.

The decorator refuses what it does not make the dataclass way: a dataclass base class, a field
outside ``__init__`` (``init=False``, ``kw_only``, ``InitVar``), a field named ``self`` or
``__...__``, a class defining ``__setattr__`` or ``__delattr__`` itself.
"""

from __future__ import annotations

import dataclasses
import inspect
import reprlib
from collections.abc import Callable
from operator import attrgetter
from typing import Any, TypeVar, dataclass_transform, overload

T = TypeVar("T")


class _Factory:
    """The default of a parameter whose field has a ``default_factory`` (the dataclass's own
    ``__init__`` uses a sentinel of its own the same way)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<factory>"


_FACTORY = _Factory()


@overload
def frozen_dataclass(cls: type[T], /) -> type[T]: ...


@overload
def frozen_dataclass(*, slots: bool = False) -> Callable[[type[T]], type[T]]: ...


@dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field, dataclasses.Field))
def frozen_dataclass(
    cls: type[T] | None = None, /, *, slots: bool = False
) -> type[T] | Callable[[type[T]], type[T]]:
    """``@value_methods`` over ``@dataclass(frozen=True, slots=slots, repr=False, eq=False)``,
    the same class, with only ``__init__`` compiled (see the module's docstring)."""

    def wrap(cls: type[T]) -> type[T]:
        return _frozen_dataclass(cls, slots)

    return wrap if cls is None else wrap(cls)


def _frozen_dataclass(cls: type[T], slots: bool) -> type[T]:
    own = cls.__dict__
    if any(dataclasses.is_dataclass(base) for base in cls.__mro__[1:]):
        raise TypeError(f"{cls.__qualname__}: frozen_dataclass takes no dataclass base class")
    for name in ("__setattr__", "__delattr__"):
        if name in own:
            # What ``@dataclass(frozen=True)`` raises for it.
            raise TypeError(f"Cannot overwrite attribute {name} in class {cls.__name__}")
    documented = bool(own.get("__doc__"))
    # The class the generated guards name: the one given, before ``slots`` remakes it.
    given = cls
    made: type[T] = dataclasses.dataclass(
        cls, init=False, repr=False, eq=False, frozen=False, slots=slots
    )
    fields = dataclasses.fields(made)  # type: ignore[arg-type]
    _check_init_fields(made, fields)
    params = made.__dataclass_params__  # type: ignore[attr-defined]
    params.frozen = True
    params.init = True
    names = tuple(field.name for field in fields)
    setattr_, delattr_ = _frozen_guards(given, names)
    for method in (setattr_, delattr_, _deferred_init(made, fields, slots)):
        method.__qualname__ = f"{made.__qualname__}.{method.__name__}"
        method.__module__ = made.__module__
        type.__setattr__(made, method.__name__, method)
    if slots:
        # What ``@dataclass(frozen=True, slots=True)`` adds so that pickling sets the slots.
        if "__getstate__" not in own:
            type.__setattr__(made, "__getstate__", _getstate)
        if "__setstate__" not in own:
            type.__setattr__(made, "__setstate__", _setstate)
    if not documented:  # named as ``@dataclass`` names it
        try:
            text_sig = str(inspect.signature(made)).replace(" -> None", "")
        except (TypeError, ValueError):
            text_sig = ""
        made.__doc__ = made.__name__ + text_sig
    return value_methods(made)


def _check_init_fields(cls: type, fields: tuple[dataclasses.Field[Any], ...]) -> None:
    names = [field.name for field in fields]
    pseudo = [f for name, f in cls.__dataclass_fields__.items() if name not in names]  # type: ignore[attr-defined]
    if any(not field.init or field.kw_only is True for field in fields) or any(
        _is_init_var(field.type) for field in pseudo
    ):
        raise TypeError(
            f"{cls.__qualname__}: frozen_dataclass needs every field, and only the fields, as "
            "positional-or-keyword __init__ parameters (no InitVar, kw_only or init=False)"
        )
    if "self" in names or any(name.startswith("__") and name.endswith("__") for name in names):
        raise TypeError(
            f"{cls.__qualname__}: frozen_dataclass takes no field named 'self' or '__...__'"
        )


def _is_init_var(annotation: object) -> bool:
    if isinstance(annotation, str):  # postponed annotations: ``InitVar[int]``, ``dc.InitVar``
        return "InitVar" in annotation
    return annotation is dataclasses.InitVar or isinstance(annotation, dataclasses.InitVar)


def _deferred_init(
    cls: type, fields: tuple[dataclasses.Field[Any], ...], slots: bool
) -> Callable[..., None]:
    """An ``__init__`` that compiles the class's own (``_init``) when the first instance is
    made, puts it on the class and hands over to it: a class that start-up defines and never
    instantiates costs no compile (0.6-2 M instructions each). Until then it has the same
    signature, annotations and names."""
    post_init = hasattr(cls, "__post_init__")

    def __init__(self: Any, /, *args: Any, **kwargs: Any) -> None:
        init = _init(cls, fields, slots, post_init)
        init.__qualname__ = f"{cls.__qualname__}.__init__"
        init.__module__ = cls.__module__
        type.__setattr__(cls, "__init__", init)
        init(self, *args, **kwargs)

    parameter = inspect.Parameter
    parameters = [parameter("self", parameter.POSITIONAL_OR_KEYWORD)]
    for field in fields:
        if field.default is not dataclasses.MISSING:
            default = field.default
        elif field.default_factory is not dataclasses.MISSING:
            default = _FACTORY
        else:
            default = parameter.empty
        parameters.append(
            parameter(
                field.name, parameter.POSITIONAL_OR_KEYWORD, default=default, annotation=field.type
            )
        )
    __init__.__signature__ = inspect.Signature(parameters, return_annotation=None)  # type: ignore[attr-defined]
    __init__.__annotations__ = _annotations(fields)
    return __init__


def _annotations(fields: tuple[dataclasses.Field[Any], ...]) -> dict[str, Any]:
    return {field.name: field.type for field in fields} | {"return": None}


def _init(
    cls: type, fields: tuple[dataclasses.Field[Any], ...], slots: bool, post_init: bool
) -> Callable[..., None]:
    """The dataclass's ``__init__``: one ``exec``, as the dataclass module makes its own. The
    generated function's own names are dunders: no field (refused above) can shadow them."""
    namespace: dict[str, Any] = {"__factory__": _FACTORY, "__set__": object.__setattr__}
    parameters: list[str] = []
    factories: list[str] = []
    for index, field in enumerate(fields):
        name = field.name
        if field.default is not dataclasses.MISSING:
            namespace[f"__default_{index}__"] = field.default
            parameters.append(f"{name}=__default_{index}__")
        elif field.default_factory is not dataclasses.MISSING:
            namespace[f"__factory_{index}__"] = field.default_factory
            parameters.append(f"{name}=__factory__")
            factories.append(
                f"    if {name} is __factory__:\n        {name} = __factory_{index}__()\n"
            )
        else:
            parameters.append(name)
    names = [field.name for field in fields]
    if slots:
        stores = "".join(f"    __set__(self, {name!r}, {name})\n" for name in names)
    else:
        stores = (
            "    __values__ = {}\n"
            + "".join(f"    __values__[{name!r}] = {name}\n" for name in names)
            + "    __set__(self, '__dict__', __values__)\n"
        )
    call_post_init = "    self.__post_init__()\n" if post_init else ""
    source = (
        f"def __init__(self, {', '.join(parameters)}):\n"
        + "".join(factories)
        + stores
        + call_post_init
        + ("" if fields or post_init else "    pass\n")
    )
    exec(source, namespace)
    init: Callable[..., None] = namespace["__init__"]
    init.__annotations__ = _annotations(fields)
    return init


def _frozen_guards(
    cls: type[Any], names: tuple[str, ...]
) -> tuple[Callable[[Any, str, Any], None], Callable[[Any, str], None]]:
    """The ``__setattr__`` and ``__delattr__`` that ``@dataclass(frozen=True)`` generates for
    ``cls`` with fields ``names``, as closures."""
    frozen_error = dataclasses.FrozenInstanceError

    def __setattr__(self: Any, name: str, value: Any) -> None:
        if type(self) is cls or name in names:
            raise frozen_error(f"cannot assign to field {name!r}")
        super(cls, self).__setattr__(name, value)

    def __delattr__(self: Any, name: str) -> None:
        if type(self) is cls or name in names:
            raise frozen_error(f"cannot delete field {name!r}")
        super(cls, self).__delattr__(name)

    return __setattr__, __delattr__


def _getstate(self: Any) -> list[Any]:
    return [getattr(self, field.name) for field in dataclasses.fields(self)]


def _setstate(self: Any, state: list[Any]) -> None:
    for field, value in zip(dataclasses.fields(self), state, strict=False):
        # Past the frozen guard, as unpickling must.
        object.__setattr__(self, field.name, value)


def _values_of(names: tuple[str, ...]) -> Callable[[Any], tuple[Any, ...]]:
    """The tuple of the named attributes (always a tuple, as the generated methods build)."""
    if len(names) >= 2:
        return attrgetter(*names)
    if names:
        (name,) = names

        def one(obj: Any) -> tuple[Any, ...]:
            return (getattr(obj, name),)

        return one
    return lambda obj: ()


def value_methods(cls: type[T]) -> type[T]:
    """Give the dataclass ``cls`` the ``__repr__``, ``__eq__`` and ``__hash__`` that
    ``@dataclass`` would have generated, without compiling them.

    Apply it directly above ``@dataclass(..., repr=False, eq=False)`` (the decorator refuses
    a class whose dataclass made them, or asked for ordering). A method the class defines
    itself stays, as with ``@dataclass``. ``__hash__`` follows the dataclass rule for
    ``eq=True``: hashed fields for a frozen class, ``None`` (unhashable) otherwise, unless the
    class defines ``__hash__`` itself."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or params.repr or params.eq or params.order or params.unsafe_hash:
        raise TypeError(
            f"{cls.__qualname__}: value_methods takes a dataclass made with repr=False, "
            "eq=False and no order or unsafe_hash"
        )
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    own = cls.__dict__
    if "__repr__" not in own:
        shown = tuple(field.name for field in fields if field.repr)

        @reprlib.recursive_repr()
        def __repr__(self: Any) -> str:
            inner = ", ".join([f"{name}={getattr(self, name)!r}" for name in shown])
            return f"{self.__class__.__qualname__}({inner})"

        __repr__.__qualname__ = f"{cls.__qualname__}.__repr__"
        type.__setattr__(cls, "__repr__", __repr__)
    explicit_hash = own.get("__hash__", dataclasses.MISSING)
    if "__eq__" not in own:
        compared = _values_of(tuple(field.name for field in fields if field.compare))

        def __eq__(self: Any, other: object) -> bool:
            if other.__class__ is self.__class__:
                return bool(compared(self) == compared(other))
            return NotImplemented

        __eq__.__qualname__ = f"{cls.__qualname__}.__eq__"
        type.__setattr__(cls, "__eq__", __eq__)
    if explicit_hash is dataclasses.MISSING or (explicit_hash is None and "__eq__" in own):
        if params.frozen:
            hashed = _values_of(
                tuple(
                    field.name
                    for field in fields
                    if (field.compare if field.hash is None else field.hash)
                )
            )

            def __hash__(self: Any) -> int:
                return hash(hashed(self))

            __hash__.__qualname__ = f"{cls.__qualname__}.__hash__"
            type.__setattr__(cls, "__hash__", __hash__)
        else:
            type.__setattr__(cls, "__hash__", None)
    return cls
