"""What the loader needs to know of the call kind a scope serves (chat, embeddings, OCR, ...).

Its sources' ``transport`` names are looked up in the call kind's registry kind; a call kind
may name the transport and the model of a source that names none, and declare transport
options that may be written as source fields (``OCR__MONKEY__1__MODE=split`` for the option
``mode``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import field
from typing import TYPE_CHECKING, Final

from polygateway.frozen import frozen_dataclass
from polygateway.transports.engine_options import ENGINE_SOURCE_FIELDS

if TYPE_CHECKING:
    from polygateway.settings import ScopeSettings


@frozen_dataclass(slots=True)
class CallKind:
    transport_kind: str = "transport"
    """The registry kind of the call kind's transports."""
    default_transport: str | None = None
    """The transport of a source that names none (``None``: ``SourceConfig``'s default)."""
    default_model: str | None = None
    """The model of a source that names none (``None``: ``MODEL`` is required)."""
    source_options: Mapping[str, str] = field(default_factory=dict)
    """Source fields (env spelling, ``MODE``) that set a transport option (``mode``)."""
    http_engine: bool = False
    """Whether the call kind's transports post through the core's HTTP engines: then the
    engine's pool and read timeout are source fields too (``READ_TIMEOUT_S``, see
    ``polygateway.transports.engine_options``), checked when the configuration loads."""
    provider_profiles: bool = True
    """Whether a source's provider must name a registered provider profile (the profiles
    describe chat and embedding APIs; another call kind's provider may only name a family)."""
    no_health_probe: str | None = None
    """Why the call kind has no cheap request to probe an open source with (``None``: it has
    one); ``{SCOPE}__BREAKER__HEALTH_PROBE`` on is then refused with this reason."""

    @property
    def source_fields(self) -> Mapping[str, str]:
        """Every source field that sets a transport option: ``source_options``, and the
        engine's when ``http_engine``."""
        if not self.http_engine:
            return self.source_options
        return {**ENGINE_SOURCE_FIELDS, **self.source_options}


def health_probe_problems(
    scope: ScopeSettings, call_kind: CallKind, key: str | None = None
) -> list[str]:
    """``{SCOPE}__BREAKER__HEALTH_PROBE`` turned on for a call kind that cannot probe: refused
    rather than accepted and ignored. ``key``: the key that set it (the env spelling when
    ``None``)."""
    reason = call_kind.no_health_probe
    if reason is None or not scope.breaker.health_probe:
        return []
    own_key = f"{scope.scope}__BREAKER__HEALTH_PROBE"
    return [
        f"{key or own_key}: scope {scope.scope} has no background health probe: {reason}. Leave "
        f"it off for this scope ({own_key}=false overrides a default): an open source is "
        "probed by the first call after its cooldown"
    ]


CHAT_CALLS: Final = CallKind(http_engine=True)
"""Chat scopes: chat transports, ``MODEL`` required; the HTTP engine's pool and read timeout may
be written as source fields (``LLM__OPENAI__1__KEEPALIVE_S=30s``)."""

__all__ = ["CHAT_CALLS", "CallKind", "health_probe_problems"]
