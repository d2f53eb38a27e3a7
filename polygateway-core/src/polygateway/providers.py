"""Built-in provider profiles (ARCHITECTURE D11): what differs between OpenAI-compatible APIs.

A profile is declared, never guessed from a model or host name. Third-party plugins add
profiles through the ``pgw_register_providers`` hook; the transport looks a source's profile
up by ``SourceConfig.provider`` and falls back to ``generic`` behaviour for unknown names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from polygateway.ports import ProviderProfile


def deepseek_thinking_body(enabled: bool) -> Mapping[str, Any]:
    """DeepSeek (also Zhipu GLM-4.5+, Doubao): top-level ``thinking: {"type": ...}``."""
    return {"thinking": {"type": "enabled" if enabled else "disabled"}}


def qwen_thinking_body(enabled: bool) -> Mapping[str, Any]:
    """Qwen / DashScope compatible mode: top-level ``enable_thinking``."""
    return {"enable_thinking": enabled}


OPENAI = ProviderProfile(
    name="openai", supports_native_schema=True, max_tokens_field="max_completion_tokens"
)
"""OpenAI: ``response_format`` with ``json_schema`` works; no on/off thinking switch."""

DEEPSEEK = ProviderProfile(name="deepseek", thinking_body=deepseek_thinking_body)

QWEN = ProviderProfile(
    name="qwen",
    thinking_body=qwen_thinking_body,
    # DashScope answers 400 to a non-streaming call with thinking on.
    thinking_requires_stream=True,
)

GENERIC = ProviderProfile(name="generic")
"""Any other OpenAI-compatible endpoint: no extra body fields, default reasoning parsing."""

BUILTIN_PROFILES: tuple[ProviderProfile, ...] = (OPENAI, DEEPSEEK, QWEN, GENERIC)


def builtin_profiles_by_name() -> dict[str, ProviderProfile]:
    """A fresh ``name -> profile`` mapping of the built-in profiles."""
    return {profile.name: profile for profile in BUILTIN_PROFILES}


__all__ = [
    "BUILTIN_PROFILES",
    "DEEPSEEK",
    "GENERIC",
    "OPENAI",
    "QWEN",
    "builtin_profiles_by_name",
    "deepseek_thinking_body",
    "qwen_thinking_body",
]
