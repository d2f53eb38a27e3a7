"""``OptionsRef``: a component's options model named by import path (re-exported by
``polygateway.options``). Its own module, importing nothing of pydantic, so that
``polygateway.ports`` can name it in ``Register``."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import field
from types import MappingProxyType
from typing import Any

from polygateway.frozen import frozen_dataclass


@frozen_dataclass(slots=True)
class OptionsRef:
    """A component's options model named by import path (``"package.module:ClassName"``).

    The model is imported when a scope picks the component, when one of its flat keys is set,
    or when its options are described (``pgw config check``); until then ``env_keys`` stands for
    it, so it must equal what the model's ``EnvKey`` metadata declares (checked on import).

    ``plain`` and ``read_plain`` (optional, both or neither) let the loader skip the model for
    the usual input: ``read_plain(options)`` returns a ``plain`` instance (a frozen dataclass with
    the model's fields and values) when it is certain of the result, else ``None`` and the model
    reads the options, so every problem is still the model's.
    """

    model: str
    env_keys: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    plain: type[Any] | None = None
    read_plain: Callable[[Mapping[str, Any]], Any] | None = None

    def load(self) -> type[Any]:
        """Import the model (a pydantic class; typed loosely so that this module, which the
        ports name, refers to no pydantic type); ``ImportError``/``AttributeError`` if the path
        names none."""
        module_name, _, attribute = self.model.partition(":")
        model: type[Any] = getattr(importlib.import_module(module_name), attribute)
        return model
