"""One configuration layer: what it is, how it is validated, and the safe rendering of values.

A layer is what one origin says about one scope: the ``{SCOPE}__...`` env keys, the flat
``LLM_*``/``PGW_*`` keys, the file's ``[defaults]`` or ``[scopes.X]`` table, or one source
entry. Every field is optional (``None`` = "this layer does not say"); the loader merges layers
and checks what must be present. Env and file go through the same models, so a value means the
same and is constrained the same wherever it is written.

The models are pydantic's, in ``layer_models.py`` (their names import from here too), with the
translation of their errors: one line each, ``<key>: <reason>[, got <value>]``, where ``<key>``
is the env key or ``file:[table].key`` the caller names through ``label``; pydantic's own
rendering is never used (it spans lines and echoes inputs, which may be secrets).
``validate_layer`` reads a layer of plain values without them (``layer_values.py``), so the
usual configuration loads without building a layer model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias
from urllib.parse import urlsplit

from polygateway.config.layer_values import LayerSpec, read_plain
from polygateway.options import is_secret_name

if TYPE_CHECKING:
    from polygateway.config.layer_models import (
        LayerModel,
    )

Loc: TypeAlias = tuple[str | int, ...]
"""A path inside a layer, e.g. ``("retry", "max_attempts")`` or ``("sources", 0, "model")``."""

# --------------------------------------------------------------------------- secrets

_SECRET_FIELDS = frozenset({"api_key"})
_FREE_FORM = frozenset({"options", "middleware_options"})


def is_secret_key(name: str) -> bool:
    """Whether a free-form option name looks like it holds a credential."""
    return is_secret_name(name)


def is_secret_loc(loc: Sequence[str | int]) -> bool:
    """Whether the value at ``loc`` may be a secret (never echoed)."""
    names = [part for part in loc if isinstance(part, str)]
    if names and names[-1] in _SECRET_FIELDS:
        return True
    for index, part in enumerate(names):
        if part in _FREE_FORM and any(is_secret_key(n) for n in names[index + 1 :]):
            return True
    return False


def mask_url(value: str) -> str:
    """``scheme://user:***@host:port/path?***``: the password and query never show."""
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError:
        return "***"
    if not parts.scheme or not parts.netloc:
        return value if "@" not in value else "***"
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    if port is not None:
        host = f"{host}:{port}"
    user = ""
    if parts.username is not None or parts.password is not None:
        user = (parts.username or "") + (":***" if parts.password is not None else "") + "@"
    query = "?***" if parts.query else ""
    return f"{parts.scheme}://{user}{host}{parts.path}{query}"


def _masked(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: "***" if is_secret_key(str(k)) else _masked(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_masked(item) for item in value]
    if isinstance(value, str) and "://" in value and "@" in value:
        return mask_url(value)
    return value


class MaskedOptions(dict[str, Any]):
    """Free-form options exactly as given, but whose ``repr`` hides credential-looking values.

    Settings reprs end up in logs and tracebacks; an option named ``password`` or a URL with a
    password in it must not.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return repr(_masked(dict(self)))

    __str__ = __repr__


def show_value(value: object) -> str | None:
    """A short, safe rendering of a rejected value, or ``None`` when it should not be shown."""
    if isinstance(value, bool | int | float):
        return repr(value)
    if isinstance(value, str):
        text = mask_url(value) if "://" in value else value
        if len(text) > 60:
            text = text[:57] + "..."
        return repr(text)
    return None


def validate_layer(
    raw: Mapping[str, Any],
    spec: LayerSpec,
    label: Callable[[Loc], str],
) -> tuple[dict[str, Any], list[str]]:
    """Validate one layer (``spec``: ``layer_values.SCOPE_COMMON``, ``SOURCE``...); returns the
    accepted values (by alias, only what was given) and problems.

    Rejected values are dropped and the rest is kept, so that one bad key does not hide the
    other problems of the same layer. Plain values are read without the model; anything else
    goes to it (``layer_models.validate_layer_with_model``).
    """
    plain = read_plain(raw, spec)
    if plain is not None:
        return plain, []
    from polygateway.config import layer_models

    model: type[LayerModel] = getattr(layer_models, spec.model)
    return layer_models.validate_layer_with_model(raw, model, label)


_MODEL_NAMES = frozenset(
    {
        "LayerModel",
        "SourceDefaultsLayer",
        "SourceLayer",
        "RetryLayer",
        "BreakerLayer",
        "BackpressureLayer",
        "GlobalLayer",
        "LimiterLayer",
        "CacheLayer",
        "TelemetryLayer",
        "StructuredLayer",
        "ScopeCommonLayer",
        "Engine",
        "HttpUrl",
        "Name",
        "NonNegativeFloat",
        "Options",
        "PositiveFloat",
        "ProviderName",
        "allowed_keys",
        "describe_error",
        "validate_options",
    }
)


def __getattr__(name: str) -> Any:
    if name in _MODEL_NAMES:
        from polygateway.config import layer_models

        return getattr(layer_models, name)
    raise AttributeError(f"module 'polygateway.config.models' has no attribute {name!r}")
