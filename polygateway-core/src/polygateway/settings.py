"""Resolved settings: plain frozen dataclasses, already validated.

Reading the environment, ``.env`` and the pipeline file is ``polygateway.config``'s job; this
module only describes the result so that ports, middleware and plugins can depend on it without
importing the loader. Secrets are held in ``Secret`` so that no repr, log line or error shows them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import field
from typing import Any, Literal, Protocol, TypeAlias

from polygateway.errors import ConfigError
from polygateway.frozen import frozen_dataclass
from polygateway.params import ChatParams


class Secret:
    """A string that never shows itself in ``repr``/``str``. ``reveal()`` returns the value."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def masked(self) -> str:
        return "***" if self._value else ""

    def __bool__(self) -> bool:
        return bool(self._value)

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = masked

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)


def _url_without_credentials(url: str) -> str:
    """``url`` with any ``user:password@`` and ``?query`` replaced by ``***``."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    authority, slash, path = rest.partition("/")
    if "@" in authority:
        authority = "***@" + authority.rpartition("@")[2]
    path, qmark, _query = path.partition("?")
    return f"{scheme}://{authority}{slash}{path}" + ("?***" if qmark else "")


DEFAULT_MAX_RESPONSE_BYTES = 64 * 1024 * 1024
"""Default cap on one response body (on the wire and decoded): far above any real answer
(a 100k-token stream is about 25 MB of events), far below what would hurt the process."""


TelemetryContent = Literal["full", "digest", "none"]
"""How much of prompts and answers telemetry rows keep."""


@frozen_dataclass(slots=True)
class Limits:
    """Concurrency / requests per minute / tokens per minute. 0 disables that gate."""

    max_concurrency: int = 0
    rpm: int = 0
    tpm: int = 0


DEFAULT_TTFT_TIMEOUT_S = 30.0
"""Default bound on the first token of a stream: far above a healthy first token (seconds),
far below the total timeout, so a silent upstream is left for another source in time."""
DEFAULT_INTER_TOKEN_TIMEOUT_S = 20.0
"""Default bound on the gap between two stream events (below the TTFT default: the rule
``inter_token < ttft < timeout``)."""


@frozen_dataclass(slots=True)
class SourceConfig:
    """One upstream account: ``{SCOPE}__{PROVIDER}__{N}__{FIELD}`` aggregated.

    Invariant (checked by the config loader): ``0 < inter_token_timeout_s < ttft_timeout_s <
    timeout_s`` for whichever of the three are set. An unset TTFT / inter-token timeout takes
    its default (30 s / 20 s) when that keeps the invariant, else stays unset (the next bound
    out then covers it).
    """

    name: str
    """Unique within the scope, ``{provider}-{n}`` by default (e.g. ``qwen-1``)."""
    provider: str
    base_url: str
    model: str
    api_key: Secret | str = field(default_factory=lambda: Secret(""), repr=False)
    """A plain ``str`` is wrapped in ``Secret`` on construction (read it as a ``Secret``)."""
    scope: str = "LLM"
    timeout_s: float = 120.0
    connect_timeout_s: float = 10.0
    ttft_timeout_s: float | None = None
    """Bound on the first token of a stream (``None``: 30 s when below ``timeout_s``)."""
    inter_token_timeout_s: float | None = None
    """Bound between stream events (``None``: 20 s when below the TTFT / total timeout)."""
    limits: Limits = field(default_factory=Limits)
    est_tokens: int = 1000
    """TPM pre-charge per attempt, and the conservative usage when the stream reports none."""
    enable_thinking: bool | None = None
    missing_done: Literal["retry", "salvage"] = "retry"
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES
    """Cap on one response body, on the wire and decoded (gzip); 0 = unlimited. Exceeding it
    is a ``TransientError`` naming the cap."""
    transport: str = "openai-compat"
    params: ChatParams = field(default_factory=ChatParams)
    """Default generation parameters of this source (``{SCOPE}__{P}__{N}__TEMPERATURE``, ...);
    a call's own values win."""
    priority: int | None = None
    """The ``priority`` selector's order: lower first; ``None`` ranks after every numbered
    source, in declared order."""
    weight: float = 1.0
    """The ``weighted`` selector's share of calls (relative to the other runnable sources)."""
    context_window: int | None = None
    """Declared context window in tokens: after a context overflow only sources declaring a
    larger one are tried."""
    options: Mapping[str, Any] = field(default_factory=dict, repr=False)
    """Transport options (e.g. ``engine``, ``trust_env``, ``headers``) from env or the pipeline
    file. Kept out of the repr: headers may carry credentials."""

    def __post_init__(self) -> None:
        api_key: Any = self.api_key
        if isinstance(api_key, str):  # SourceConfig(api_key="sk-...") is the obvious spelling
            object.__setattr__(self, "api_key", Secret(api_key))
        elif not isinstance(api_key, Secret):
            raise TypeError(f"api_key must be a str or Secret, got {type(api_key).__name__}")
        # Defaults that fit the timeouts set: a silent upstream never holds a call for the
        # whole total timeout unless the user asked for that.
        if self.ttft_timeout_s is None and _fits(DEFAULT_TTFT_TIMEOUT_S, self.timeout_s):
            object.__setattr__(self, "ttft_timeout_s", DEFAULT_TTFT_TIMEOUT_S)
        if self.inter_token_timeout_s is None:
            outer = self.ttft_timeout_s if self.ttft_timeout_s is not None else self.timeout_s
            if _fits(DEFAULT_INTER_TOKEN_TIMEOUT_S, outer):
                object.__setattr__(self, "inter_token_timeout_s", DEFAULT_INTER_TOKEN_TIMEOUT_S)

    def api_key_value(self) -> str:
        """The API key in clear text (for the transport's header only)."""
        key = self.api_key
        return key.reveal() if isinstance(key, Secret) else key

    def __repr__(self) -> str:
        # Hand-written so that no credential shows: the key, a password or query in the URL,
        # and the options (headers may carry tokens) stay out.
        return (
            f"SourceConfig(name={self.name!r}, provider={self.provider!r}, "
            f"base_url={_url_without_credentials(self.base_url)!r}, model={self.model!r}, "
            f"scope={self.scope!r}, timeout_s={self.timeout_s!r}, limits={self.limits!r})"
        )


def _fits(default: float, outer: object) -> bool:
    """Whether ``default`` is below the bound ``outer`` (a bad ``outer`` is the loader's to
    report, not this check's)."""
    return isinstance(outer, int | float) and default < outer


@frozen_dataclass(slots=True)
class RetrySettings:
    max_attempts: int = 3
    base_delay_s: float = 1.0
    max_delay_s: float = 30.0
    same_source_attempts: int = 1
    """Extra tries on the same source after a 5xx, a reset or a timeout before headers (429s
    never: they wait for a short Retry-After or switch), inside ``max_attempts``."""
    wait_retry_after_up_to_s: float = 3.0
    """A Retry-After at or below this is waited on the same source; above it, the source cools
    and the call switches."""
    max_retry_after_s: float = 60.0
    """Cap on an honoured Retry-After (an absurd hint cools the source this long at most)."""
    call_deadline_s: float | None = None
    """Default end-to-end deadline of one call (attempts, backoff, admission waits)."""
    switch_on_content_filter: bool = False
    """A content-policy refusal tries another source instead of raising at once."""


DEFAULT_COOLDOWN_S = 5.0
"""First cooldown of an opened breaker: a blip costs seconds, not a minute."""
DEFAULT_MAX_COOLDOWN_S = 60.0
"""Cap of the doubling cooldown (5, 10, 20, 40, 60, 60 s...): a dead source costs about one
probe a minute, fewer than a fixed 30 s cooldown would send."""


@frozen_dataclass(slots=True)
class BreakerSettings:
    fail_threshold: int = 5
    cooldown_s: float = DEFAULT_COOLDOWN_S
    """The first cooldown after the breaker opens."""
    probe_ttl_s: float | None = None
    """``None`` derives ``max(2 x max timeout, cooldown, max timeout + 5)`` at assembly."""
    max_cooldown_s: float | None = None
    """Cap of the cooldown, which doubles on every failed probe in a row; ``None`` derives
    ``max(60, cooldown_s)``; equal to ``cooldown_s``: a fixed cooldown."""
    health_probe: bool = False
    """Probe an open source in the background (one cheap request per cooldown) instead of
    letting the first call after the cooldown find out."""

    @property
    def cooldown_cap_s(self) -> float:
        """The cap the cooldown grows to (``max_cooldown_s`` or its derived default)."""
        if self.max_cooldown_s is not None:
            return self.max_cooldown_s
        return max(DEFAULT_MAX_COOLDOWN_S, self.cooldown_s)


@frozen_dataclass(slots=True)
class BackpressureSettings:
    quota_full: Literal["wait", "fail_fast"] = "wait"
    stall_window_s: float = 300.0
    poll_interval_s: float = 0.5
    lease_ttl_s: float | None = None
    """Limiter lease TTL; ``None`` derives ``max timeout + 30``."""


class OptionsModel(Protocol):
    """A validated options model instance (a ``polygateway.options.ComponentOptions``, i.e. a
    pydantic model), described structurally so that settings need not import pydantic."""

    def model_dump(self) -> dict[str, Any]: ...


ComponentOptionsValue: TypeAlias = "Mapping[str, Any] | OptionsModel"
"""A component's options: the instance of the options model its plugin registered (what the
loader produces), or a plain mapping (hand-built settings, or a factory registered without a
model; assembly validates a mapping with the model when there is one)."""


@frozen_dataclass(slots=True)
class ComponentChoice:
    """A registered implementation picked by name, with its options."""

    name: str
    options: ComponentOptionsValue = field(default_factory=dict)


@frozen_dataclass(slots=True)
class CacheSettings:
    backend: str = "memory"
    """Registered cache name, or ``none``."""
    namespace: str | None = None
    ttl_s: float | None = None
    options: ComponentOptionsValue = field(default_factory=dict)


@frozen_dataclass(slots=True)
class TelemetrySettings:
    backend: str = "sqlite"
    """Registered telemetry recorder name, or ``none``; several names joined by ``,`` fan every
    row out to each of them (``backends``)."""
    sqlite_path: str = "pgw_telemetry.db"
    options: ComponentOptionsValue = field(default_factory=dict)
    """The recorder's options; with several backends, ``{name: that backend's options}``."""

    @property
    def backends(self) -> tuple[str, ...]:
        """The recorder names ``backend`` spells (empty when telemetry is off)."""
        names = tuple(part.strip() for part in self.backend.split(","))
        return () if names == ("none",) else tuple(name for name in names if name)

    content: TelemetryContent = "full"
    """What rows keep of prompts and answers: ``full`` text, a ``digest`` (sha256) of each, or
    ``none`` (empty). Env ``PGW_TELEMETRY_CONTENT``, file ``[..telemetry].content``."""


@frozen_dataclass(slots=True)
class ScopeSettings:
    """Everything needed to assemble one client for one scope (logical role)."""

    scope: str
    sources: tuple[SourceConfig, ...]
    retry: RetrySettings = field(default_factory=RetrySettings)
    breaker: BreakerSettings = field(default_factory=BreakerSettings)
    backpressure: BackpressureSettings = field(default_factory=BackpressureSettings)
    global_limits: Limits = field(default_factory=Limits)
    selector: str = "round_robin"
    limiter: ComponentChoice = field(default_factory=lambda: ComponentChoice("memory"))
    breaker_backend: ComponentChoice = field(default_factory=lambda: ComponentChoice("memory"))
    cache: CacheSettings = field(default_factory=CacheSettings)
    telemetry: TelemetrySettings = field(default_factory=TelemetrySettings)
    pricing_path: str | None = None
    structured_strategy: str = "auto"
    max_structured_retries: int = 1
    middleware: tuple[str, ...] = ("telemetry", "cache", "structured")
    """The wrapping layers, outer -> inner; the governed chat dispatcher is always innermost
    (``"retry"``, the name it had as a layer, is accepted with a ``DeprecationWarning``)."""
    middleware_options: Mapping[str, ComponentOptionsValue] = field(default_factory=dict)
    """Layer -> its options (see ``ComponentOptionsValue``)."""
    batch_size: int | None = None
    """Embedding scopes only: texts per request."""
    batch_concurrency: int = 1
    """Embedding scopes only: batches in flight at once (1 = one after the other)."""

    @property
    def max_timeout_s(self) -> float:
        return max((s.timeout_s for s in self.sources), default=0.0)

    @property
    def max_ttft_s(self) -> float:
        return max((s.ttft_timeout_s or 0.0 for s in self.sources), default=0.0)

    @property
    def lease_ttl_s(self) -> float:
        configured = self.backpressure.lease_ttl_s
        return configured if configured is not None else self.max_timeout_s + 30.0

    @property
    def probe_ttl_s(self) -> float:
        configured = self.breaker.probe_ttl_s
        if configured is not None:
            return configured
        t = self.max_timeout_s
        return max(2 * t, self.breaker.cooldown_s, t + 5.0)

    def effective_fail_threshold(self, source: SourceConfig) -> int:
        """The breaker threshold a source gets: ``max(configured, 2 x its concurrency)``
        (ARCHITECTURE §7.4), so that one burst of in-flight failures cannot open it alone."""
        return effective_fail_threshold(self.breaker.fail_threshold, source)

    def source(self, name: str) -> SourceConfig:
        for s in self.sources:
            if s.name == name:
                return s
        raise KeyError(name)


@frozen_dataclass(slots=True)
class GatewaySettings:
    """All scopes found in env and the pipeline file."""

    scopes: Mapping[str, ScopeSettings]

    def scope(self, name: str) -> ScopeSettings:
        """The settings of scope ``name``; ``ConfigError`` naming the configured ones if absent."""
        found = self.scopes.get(name)
        if found is None:
            known = ", ".join(sorted(self.scopes)) or "none"
            raise ConfigError(f"unknown scope {name!r}; configured scopes: {known}")
        return found


def effective_fail_threshold(configured: int, source: SourceConfig) -> int:
    """``max(configured, 2 x source.limits.max_concurrency)`` (ARCHITECTURE §7.4)."""
    return max(configured, source.limits.max_concurrency * 2)
