"""The pydantic models of one configuration layer (the definition of a layer), and the
translation of their errors into one line per problem.

Imported when a layer needs them: a value ``layer_values.read_plain`` cannot vouch for, a
problem to describe, a component's options model. See ``models.py`` for what a layer is.
"""

from __future__ import annotations

import copy
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
)

from polygateway.config.layer_values import http_url
from polygateway.config.models import Loc, is_secret_loc, show_value
from polygateway.config.suggest import did_you_mean
from polygateway.options import (
    BOOL_WORDS,
    MAX_DURATION_S,
    Bool,
    NonNegativeDuration,
    NonNegativeInt,
    Number,
    PositiveDuration,
    PositiveInt,
    env_keys,
    is_secret_field,
)

# The vocabulary every option shares (``polygateway.options``): ``2.5s``/``yes`` mean the same in
# a core key and in a plugin's option.
PositiveFloat = PositiveDuration
NonNegativeFloat = NonNegativeDuration
Name = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1)]
ProviderName = Annotated[
    str,
    StringConstraints(strip_whitespace=True, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$"),
]
HttpUrl = Annotated[str, StringConstraints(strip_whitespace=True), AfterValidator(http_url)]
Options = dict[str, Any]

Engine = Literal["aiohttp", "httpx", "httpx-aiohttp", "httpx2", "httptools"]


class LayerModel(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        hide_input_in_errors=True,
        allow_inf_nan=False,
        populate_by_name=False,
    )


class SourceDefaultsLayer(LayerModel):
    """Per-source settings that can also be given once for every source of a scope."""

    timeout_s: PositiveFloat | None = None
    connect_timeout_s: PositiveFloat | None = None
    ttft_timeout_s: PositiveFloat | None = None
    inter_token_timeout_s: PositiveFloat | None = None
    max_concurrency: NonNegativeInt | None = None
    rpm: NonNegativeInt | None = None
    tpm: NonNegativeInt | None = None
    est_tokens: PositiveInt | None = None
    enable_thinking: Bool | None = None
    missing_done: Literal["retry", "salvage"] | None = None
    max_response_bytes: NonNegativeInt | None = None
    transport: Name | None = None
    engine: Engine | None = None
    trust_env: Bool | None = None
    options: Options | None = None
    # Default generation parameters (polygateway.params.ChatParams); a call's own values win.
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    max_tokens: PositiveInt | None = None
    seed: NonNegativeInt | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    stop: Name | list[Name] | None = None
    user: Name | None = None
    parallel_tool_calls: Bool | None = None


class SourceLayer(SourceDefaultsLayer):
    """One upstream account: ``{SCOPE}__{PROVIDER}__{N}__{FIELD}`` or ``[[scopes.X.sources]]``."""

    provider: ProviderName | None = None
    name: Name | None = None
    base_url: HttpUrl | None = None
    model: Name | None = None
    api_key: str | None = None
    api_key_env: Name | None = None
    priority: NonNegativeInt | None = None
    # A share, not a duration; bounded like one so that every number has a range.
    weight: Annotated[Number, Field(gt=0, le=MAX_DURATION_S)] | None = None
    context_window: PositiveInt | None = None


class RetryLayer(LayerModel):
    max_attempts: PositiveInt | None = None
    base_delay_s: NonNegativeFloat | None = None
    max_delay_s: NonNegativeFloat | None = None
    same_source_attempts: NonNegativeInt | None = None
    wait_retry_after_up_to_s: NonNegativeFloat | None = None
    max_retry_after_s: PositiveFloat | None = None
    call_deadline_s: PositiveFloat | None = None
    switch_on_content_filter: Bool | None = None


class BreakerLayer(LayerModel):
    fail_threshold: PositiveInt | None = None
    cooldown_s: PositiveFloat | None = None
    probe_ttl_s: PositiveFloat | None = None
    max_cooldown_s: PositiveFloat | None = None
    health_probe: Bool | None = None
    backend: Name | None = None
    options: Options | None = None


class BackpressureLayer(LayerModel):
    quota_full: Literal["wait", "fail_fast"] | None = None
    stall_window_s: PositiveFloat | None = None
    poll_interval_s: PositiveFloat | None = None
    lease_ttl_s: PositiveFloat | None = None


class GlobalLayer(LayerModel):
    max_concurrency: NonNegativeInt | None = None
    rpm: NonNegativeInt | None = None
    tpm: NonNegativeInt | None = None


class LimiterLayer(LayerModel):
    name: Name | None = None
    options: Options | None = None


class CacheLayer(LayerModel):
    backend: Name | None = None
    namespace: Name | None = None
    ttl_s: PositiveFloat | None = None
    options: Options | None = None


class TelemetryLayer(LayerModel):
    backend: Name | list[Name] | None = None
    """One recorder, or a list of them (every row goes to each: a fan-out)."""
    sqlite_path: Name | None = None
    content: Literal["full", "digest", "none"] | None = None
    options: Options | None = None


class StructuredLayer(LayerModel):
    strategy: Name | None = None
    max_retries: NonNegativeInt | None = None


class ScopeCommonLayer(LayerModel):
    """A scope table without its sources; also the shape of ``[defaults]`` and the flat keys."""

    state: Name | None = None
    middleware: list[Name] | None = None
    selector: Name | None = None
    batch_size: PositiveInt | None = None
    batch_concurrency: PositiveInt | None = None
    pricing_path: Name | None = None
    retry: RetryLayer | None = None
    breaker: BreakerLayer | None = None
    backpressure: BackpressureLayer | None = None
    global_limits: GlobalLayer | None = Field(default=None, alias="global")
    limiter: LimiterLayer | None = None
    cache: CacheLayer | None = None
    telemetry: TelemetryLayer | None = None
    structured: StructuredLayer | None = None
    source_defaults: SourceDefaultsLayer | None = None
    middleware_options: dict[Name, Options] | None = None


# --------------------------------------------------------------------------- errors


def _unwrap_model(annotation: Any) -> type[BaseModel] | None:
    """The model class inside ``X | None``, ``list[X]``, ``dict[str, X]``, if any."""
    origin = typing.get_origin(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if origin is typing.Union or origin is types.UnionType or origin in (list, dict):
        for arg in typing.get_args(annotation):
            found = _unwrap_model(arg)
            if found is not None:
                return found
    return None


def allowed_keys(root: type[BaseModel], table: Loc) -> list[str]:
    """The keys the table at ``table`` (a path below ``root``) accepts."""
    model: type[BaseModel] | None = root
    for part in table:
        if model is None:
            return []
        if isinstance(part, int):
            continue
        field = next(
            (f for n, f in model.model_fields.items() if (f.alias or n) == part),
            None,
        )
        if field is None:
            return []
        model = _unwrap_model(field.annotation)
    if model is None:
        return []
    return sorted(f.alias or n for n, f in model.model_fields.items())


def _number(value: Any) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))  # 31622400, not 3.16224e+07
    return f"{value:g}" if isinstance(value, float) else str(value)


def _reason(error: Mapping[str, Any], root: type[BaseModel]) -> str:
    kind = str(error["type"])
    ctx: Mapping[str, Any] = error.get("ctx") or {}
    if kind == "extra_forbidden":
        allowed = allowed_keys(root, tuple(error["loc"][:-1]))
        hint = did_you_mean(str(error["loc"][-1]), allowed)
        return f"unknown key{hint}; allowed: " + ", ".join(allowed)
    simple = {
        "missing": "required",
        "int_parsing": "must be an integer",
        "int_type": "must be an integer",
        "int_from_float": "must be an integer",
        "float_parsing": "must be a number",
        "float_type": "must be a number",
        "finite_number": "must be a finite number",
        "bool_parsing": f"must be {BOOL_WORDS}",
        "bool_type": f"must be {BOOL_WORDS}",
        "string_type": "must be a string",
        "string_too_short": "must not be empty",
        "dict_type": "must be a table",
        "model_type": "must be a table",
        "model_attributes_type": "must be a table",
        "list_type": "must be a list",
    }
    if kind in simple:
        return simple[kind]
    if kind == "literal_error":
        return f"must be {ctx.get('expected', '')}"
    if kind == "greater_than":
        return f"must be > {_number(ctx.get('gt'))}"
    if kind == "greater_than_equal":
        return f"must be >= {_number(ctx.get('ge'))}"
    if kind == "less_than_equal":
        return f"must be <= {_number(ctx.get('le'))}"
    if kind == "less_than":
        return f"must be < {_number(ctx.get('lt'))}"
    if kind == "string_pattern_mismatch":
        return "must start with a letter or digit and contain only letters, digits, '_', '-', '.'"
    if kind == "value_error":
        return str(ctx.get("error") or error.get("msg", "invalid value"))
    return str(error.get("msg", "invalid value")).splitlines()[0]


def describe_error(
    error: Mapping[str, Any],
    root: type[BaseModel],
    label: Callable[[Loc], str],
    prefix: Loc = (),
) -> str:
    """One readable line for one pydantic error; secrets and unknown keys' values never shown."""
    loc: Loc = tuple(error["loc"])
    # Dict-key errors carry a synthetic "[key]" segment; the key itself is the useful part.
    loc = tuple(p for p in loc if not (isinstance(p, str) and p == "[key]"))
    line = f"{label(prefix + loc)}: {_reason(error, root)}"
    secret = is_secret_loc(prefix + loc) or _secret_in(root, loc)
    if error["type"] not in ("extra_forbidden", "missing") and not secret:
        shown = show_value(error.get("input"))
        if shown is not None:
            line += f", got {shown}"
    return line


def _secret_in(root: type[BaseModel], loc: Loc) -> bool:
    """Whether ``loc`` (below ``root``) is a field typed as a secret, at any depth."""
    model: type[BaseModel] | None = root
    for part in loc:
        if model is None:
            return False
        if isinstance(part, int):
            continue
        if is_secret_field(model, part):
            return True
        info = next((f for n, f in model.model_fields.items() if (f.alias or n) == part), None)
        model = _unwrap_model(info.annotation) if info is not None else None
    return False


def validate_options(
    raw: Mapping[str, Any], model: type[BaseModel], label: Callable[[Loc], str]
) -> tuple[BaseModel | None, list[str]]:
    """A component's options validated by its model: the instance, or ``None`` and one line per
    problem (``<label>: <reason>``, secrets never shown)."""
    try:
        return model.model_validate(dict(raw)), []
    except ValidationError as exc:
        flat = env_keys(model)
        problems: list[str] = []
        for error in exc.errors(include_url=False):
            line = describe_error(error, model, label)
            where = tuple(error["loc"])
            if error["type"] == "missing" and len(where) == 1 and str(where[0]) in flat:
                line += f" (env {flat[str(where[0])]})"
            problems.append(line)
        return None, problems


def _prune(data: dict[str, Any], locs: Sequence[Loc]) -> dict[str, Any]:
    """A copy of ``data`` without the values at ``locs`` (the rejected ones)."""
    pruned = copy.deepcopy(data)
    removals: list[tuple[Any, str | int]] = []
    for loc in locs:
        node: Any = pruned
        parent: Any = None
        last: str | int | None = None
        for part in loc:
            in_dict = isinstance(node, dict) and part in node
            in_list = isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)
            if not (in_dict or in_list):
                break
            parent, last, node = node, part, node[part]
        if parent is not None and last is not None:
            removals.append((parent, last))
    # Delete list items from the highest index down so earlier deletions do not shift later ones.
    removals.sort(key=lambda item: item[1] if isinstance(item[1], int) else -1, reverse=True)
    for parent, key in removals:
        if isinstance(parent, dict):
            parent.pop(key, None)
        elif isinstance(key, int) and key < len(parent):
            del parent[key]
    return pruned


def validate_layer_with_model(
    raw: Mapping[str, Any],
    model: type[LayerModel],
    label: Callable[[Loc], str],
) -> tuple[dict[str, Any], list[str]]:
    """Validate one layer; returns the accepted values (by alias, only what was given) and problems.

    Rejected values are dropped and the rest is kept, so that one bad key does not hide the
    other problems of the same layer.
    """
    problems: list[str] = []
    data = dict(raw)
    for attempt in range(3):
        try:
            validated = model.model_validate(data)
        except ValidationError as exc:
            errors = exc.errors(include_url=False)
            if attempt == 0:
                problems.extend(describe_error(e, model, label) for e in errors)
            data = _prune(data, [tuple(e["loc"]) for e in errors])
            continue
        return validated.model_dump(by_alias=True, exclude_unset=True), problems
    return {}, problems
