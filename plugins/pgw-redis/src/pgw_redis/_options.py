"""Typed values of component options (the pipeline file's ``options`` tables).

An option may arrive as TOML gave it or as a string (``"false"``, ``"2.5"``), so each is parsed
by what it means, never by Python truthiness: ``bool("false")`` is true. Anything else is a
``ConfigError`` naming the component and the option.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from polygateway.errors import ConfigError

_T = TypeVar("_T")

_TRUE = frozenset(("true", "1", "yes"))
_FALSE = frozenset(("false", "0", "no"))


def parse_bool(value: object, name: str, component: str) -> bool:
    """``True``/``False``, or ``true``/``false``, ``yes``/``no``, ``1``/``0`` (any case)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _TRUE:
            return True
        if word in _FALSE:
            return False
    elif type(value) is int and value in (0, 1):
        return value == 1
    raise _invalid(component, name, "a boolean (true/false, yes/no, 1/0)", value)


def parse_number(value: object, name: str, component: str) -> float:
    """An int, a float or a decimal string, as a float (its range is the caller's to check)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return _from_string(value, float, name, component, "a number")


def parse_int(value: object, name: str, component: str) -> int:
    """An int or a string of one (its range is the caller's to check)."""
    if type(value) is int:
        return value
    return _from_string(value, int, name, component, "an integer")


def parse_str(value: object, name: str, component: str) -> str:
    if isinstance(value, str):
        return value
    raise _invalid(component, name, "a string", value)


def _from_string(
    value: object, convert: Callable[[str], _T], name: str, component: str, expected: str
) -> _T:
    if isinstance(value, str):
        try:
            return convert(value.strip())
        except ValueError:
            pass
    raise _invalid(component, name, expected, value)


def _invalid(component: str, name: str, expected: str, value: object) -> ConfigError:
    return ConfigError(
        f"{component} backend redis: option {name} must be {expected}, got {value!r}"
    )
