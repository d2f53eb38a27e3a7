"""The pydantic side of ``polygateway.options``: the field types of the option vocabulary,
``ComponentOptions`` and the helpers that read an options model. Import them from
``polygateway.options`` (which loads this module on first use)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    SecretStr,
)

from polygateway.options import (
    MAX_COUNT,
    MAX_DURATION_S,
    is_secret_name,
    parse_bool,
    parse_duration,
    parse_int,
    parse_number,
)
from polygateway.settings import Secret


def _secret(value: object) -> Secret:
    if isinstance(value, Secret):
        return value
    if isinstance(value, SecretStr):
        return Secret(value.get_secret_value())
    if isinstance(value, str):
        return Secret(value.strip())
    raise ValueError("must be a string")


Bool = Annotated[bool, BeforeValidator(parse_bool)]
Int = Annotated[int, BeforeValidator(parse_int)]
PositiveInt = Annotated[Int, Field(ge=1, le=MAX_COUNT)]
NonNegativeInt = Annotated[Int, Field(ge=0, le=MAX_COUNT)]
Number = Annotated[float, BeforeValidator(parse_number)]
Duration = Annotated[float, BeforeValidator(parse_duration)]
PositiveDuration = Annotated[Duration, Field(gt=0, le=MAX_DURATION_S)]
NonNegativeDuration = Annotated[Duration, Field(ge=0, le=MAX_DURATION_S)]
SecretText = Annotated[
    Secret, PlainValidator(_secret), PlainSerializer(lambda secret: secret.masked())
]
"""A string held in the core's ``Secret``: never shown in reprs, problems or ``pgw config``."""


class ComponentOptions(BaseModel):
    """Base of an options model: frozen, unknown keys refused, inputs never echoed, and a repr
    that hides credential-looking values even when a field is typed as a plain ``str``."""

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        hide_input_in_errors=True,
        allow_inf_nan=False,
    )

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        for name, value in super().__repr_args__():
            if isinstance(value, Secret | SecretStr):
                yield name, value  # masks itself
            elif (name is not None and is_secret_name(name)) or (
                isinstance(value, str) and "://" in value and "@" in value
            ):
                yield name, "***"
            else:
                yield name, value


def is_secret_field(model: type[BaseModel], name: str) -> bool:
    """Whether option ``name`` of ``model`` is typed as a secret (``SecretText``/``SecretStr``)."""
    info = next(
        (f for n, f in model.model_fields.items() if (f.alias or n) == name),
        None,
    )
    if info is None:
        return False
    return _holds_secret(info.annotation) or any(
        isinstance(meta, PlainValidator) and meta.func is _secret for meta in info.metadata
    )


def _holds_secret(annotation: Any) -> bool:
    if isinstance(annotation, type) and issubclass(annotation, Secret | SecretStr):
        return True
    args: tuple[Any, ...] = getattr(annotation, "__args__", ()) or ()
    return any(_holds_secret(arg) for arg in args)


def dump_options(options: BaseModel | Mapping[str, Any]) -> dict[str, Any]:
    """Every option value (defaults included) by key, secrets still wrapped (for describing)."""
    if isinstance(options, BaseModel):
        return {
            (info.alias or name): getattr(options, name)
            for name, info in type(options).model_fields.items()
        }
    return dict(options)
