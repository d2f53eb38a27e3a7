"""A JSON-able view of resolved settings with every secret masked (for ``pgw config check``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, SecretStr

from polygateway.config.models import is_secret_key, mask_url
from polygateway.options import dump_options
from polygateway.settings import GatewaySettings, ScopeSettings, Secret

MASK = "***"


def _plain(value: Any, name: str = "") -> Any:
    """Dataclasses, options models, mappings and sequences as JSON types; secrets masked."""
    if isinstance(value, Secret | SecretStr):
        raw = value.reveal() if isinstance(value, Secret) else value.get_secret_value()
        if not raw:
            return None
        # A URL keeps its host visible (useful to check); its password and query never show.
        return mask_url(raw) if "://" in raw else MASK
    if isinstance(value, BaseModel):  # a component's validated options, defaults included
        value = dump_options(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name), f.name) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        if name == "headers":  # any header may carry a credential (Cookie, X-Api-Key, ...)
            return {str(key): MASK for key in value}
        # A typed secret masks itself (keeping a URL's host); a plain value under a
        # credential-looking name is masked whole.
        return {
            str(key): _plain(item, str(key))
            if isinstance(item, Secret | SecretStr) or not is_secret_key(str(key))
            else MASK
            for key, item in value.items()
        }
    if isinstance(value, list | tuple):
        return [_plain(item, name) for item in value]
    if isinstance(value, str):
        # A URL may carry a password or a key in its query (``?api_key=...``).
        return mask_url(value) if "://" in value else value
    if value is None or isinstance(value, bool | int | float):
        return value
    return str(value)


def describe_scope(scope: ScopeSettings) -> dict[str, Any]:
    described: dict[str, Any] = _plain(scope)
    described["effective"] = effective_values(scope)
    return described


def effective_values(scope: ScopeSettings) -> dict[str, Any]:
    """The values the code derives, each with how (what ``pgw config check`` shows)."""
    longest = scope.max_timeout_s
    lease = (
        "configured"
        if scope.backpressure.lease_ttl_s is not None
        else (f"derived: longest source timeout {longest:g} + 30")
    )
    probe = (
        "configured"
        if scope.breaker.probe_ttl_s is not None
        else (
            f"derived: max(2 x longest timeout {longest:g}, cooldown {scope.breaker.cooldown_s:g}, "
            f"longest timeout + 5)"
        )
    )
    configured = scope.breaker.fail_threshold
    return {
        "max_timeout_s": longest,
        "max_ttft_s": scope.max_ttft_s,
        "lease_ttl_s": scope.lease_ttl_s,
        "lease_ttl": lease,
        "probe_ttl_s": scope.probe_ttl_s,
        "probe_ttl": probe,
        "breaker_fail_threshold": {
            source.name: scope.effective_fail_threshold(source) for source in scope.sources
        },
        "breaker_fail_threshold_rule": (
            f"max(configured {configured}, 2 x the source's max_concurrency)"
        ),
        "telemetry_sinks": list(scope.telemetry.backends),
        "telemetry_fanout": (
            "every row goes to each sink; one failing sink never affects the others or the "
            "call; rows a sink loses are counted per sink (FanoutRecorder.drops)"
            if len(scope.telemetry.backends) > 1
            else "single recorder"
        ),
    }


def describe_settings(settings: GatewaySettings) -> dict[str, Any]:
    """``{"scopes": {name: {...}}, "warnings": [...]}``: JSON-able, secrets shown as ``***``.

    ``effective`` holds the derived values (lease and probe TTLs) the guards checked.
    ``warnings`` names scopes that have settings but no sources (they cannot be assembled).
    """
    warnings = [
        f"{name}: scope has settings but no sources (expected {name}__<PROVIDER>__<N>__BASE_URL "
        f"and {name}__<PROVIDER>__<N>__MODEL, or [[scopes.{name}.sources]])"
        for name, scope in settings.scopes.items()
        if not scope.sources
    ]
    return {
        "scopes": {name: describe_scope(scope) for name, scope in settings.scopes.items()},
        "warnings": warnings,
    }
