"""Cheaper dataclass machinery for the project's own dataclasses, same objects.

``value_methods``: the ``__repr__``, ``__eq__`` and ``__hash__`` that ``@dataclass`` generates,
made as closures instead of compiled source text. Python 3.11 compiles every generated method
with an ``exec`` of its own, and a default client defines some sixty dataclasses at start-up:
these three methods of each were about 90 M of its instructions (``tools/bench/RESULTS.md``,
section "start-up"). The results are the generated methods' (same fields, same order, same
tuples hashed, ``NotImplemented`` for another class, ``...`` for a recursive repr).

``fast_frozen_init``: a cheaper ``__init__`` for the frozen dataclasses made on every call.

A frozen dataclass's generated ``__init__`` sets each field with ``object.__setattr__`` (the
class's own ``__setattr__`` raises): about 1,300 CPU instructions a field on Python 3.11, 31k
for the 20 fields of ``LLMResponse``, and a governed call makes several such objects. The
``__init__`` made here takes the same parameters (names, order, defaults, default factories),
stores the fields into a new dict and makes it the instance's ``__dict__``: 11.7k for 20
fields, the same object (equal fields in field order, same repr, hash, pickling and
frozenness).

Why a dict of its own: storing into ``self.__dict__`` (the class's shared-key dict) is cheaper
to build (8.7k), but attribute reads of a split dict are not specialised on 3.11 (380
instructions a read against 112), and these objects are read 20 to 80 times a call. A dict
display of more than 15 pairs is no faster: it grows one ``MAP_ADD`` at a time.

The dataclass's own ``__init__`` stays the definition: the decorator refuses every class whose
``__init__`` does more than assign its fields (``__post_init__``, ``InitVar``, keyword-only or
``init=False`` fields) or has no ``__dict__`` (``__slots__``).
"""

from __future__ import annotations

import dataclasses
import reprlib
from collections.abc import Callable
from operator import attrgetter
from typing import Any, TypeVar

T = TypeVar("T")


class _Factory:
    """The default of a parameter whose field has a ``default_factory`` (the dataclass's own
    ``__init__`` uses a sentinel of its own the same way)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<factory>"


_FACTORY = _Factory()


def fast_frozen_init(cls: type[T]) -> type[T]:
    """Give the frozen dataclass ``cls`` an ``__init__`` that writes its ``__dict__`` at once.

    Apply it above ``@dataclass(frozen=True)``; raises ``TypeError`` for a class whose fields
    are not all plain positional-or-keyword ``__init__`` parameters."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen:
        raise TypeError(f"{cls.__qualname__}: fast_frozen_init takes a frozen dataclass")
    if "__slots__" in cls.__dict__ or hasattr(cls, "__post_init__"):
        raise TypeError(
            f"{cls.__qualname__}: fast_frozen_init needs a class with a __dict__ and no "
            "__post_init__"
        )
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    names = [field.name for field in fields]
    plain = cls.__init__.__code__
    if (
        plain.co_varnames[1 : plain.co_argcount] != tuple(names)
        or plain.co_kwonlyargcount
        or any(not field.init for field in fields)
    ):
        raise TypeError(
            f"{cls.__qualname__}: fast_frozen_init needs every field, and only the fields, as "
            "positional-or-keyword __init__ parameters (no InitVar, kw_only or init=False)"
        )
    if "self" in names or any(name.startswith("__") and name.endswith("__") for name in names):
        raise TypeError(
            f"{cls.__qualname__}: fast_frozen_init takes no field named 'self' or '__...__'"
        )
    # The generated function's own names are dunders: no field (refused above) can shadow them.
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
    source = (
        f"def __init__(self, {', '.join(parameters)}):\n"
        + "".join(factories)
        + "    __values__ = {}\n"
        + "".join(f"    __values__[{name!r}] = {name}\n" for name in names)
        + "    __set__(self, '__dict__', __values__)\n"
    )
    exec(source, namespace)  # the dataclass module makes its __init__ the same way
    init = namespace["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    cls.__init__ = init  # type: ignore[method-assign]
    return cls


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
