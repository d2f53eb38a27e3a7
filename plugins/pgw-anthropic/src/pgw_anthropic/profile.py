"""The ``anthropic`` provider profile: how ``enable_thinking`` is spelled on the Messages API."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from polygateway.ports import ProviderProfile

DEFAULT_THINKING_BUDGET = 1024
"""``budget_tokens`` when the source sets no ``thinking_budget_tokens`` option (the API's
minimum is 1024)."""


def anthropic_thinking_body(enabled: bool) -> Mapping[str, Any]:
    """``thinking: {type: enabled, budget_tokens}`` or ``{type: disabled}``."""
    if enabled:
        return {"thinking": {"type": "enabled", "budget_tokens": DEFAULT_THINKING_BUDGET}}
    return {"thinking": {"type": "disabled"}}


ANTHROPIC_PROFILE = ProviderProfile(name="anthropic", thinking_body=anthropic_thinking_body)

__all__ = ["ANTHROPIC_PROFILE", "DEFAULT_THINKING_BUDGET", "anthropic_thinking_body"]
