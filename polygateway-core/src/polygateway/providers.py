"""Built-in provider profiles (ARCHITECTURE D11): what differs between OpenAI-compatible APIs.

A profile is declared, never guessed from a model or host name. Third-party plugins add
profiles through the ``pgw_register_providers`` hook; the transport looks a source's profile
up by ``SourceConfig.provider`` and falls back to ``generic`` behaviour for unknown names.

Error rules (``ErrorRule``) are data: a profile lists the answers of its provider that the
status alone would misclassify; the rules every provider shares (OpenAI's quota codes and
messages, deterministic client-error codes) are ``transports.errors.COMMON_ERROR_RULES``. A
plugin adds rules with a profile of its own, e.g.
``ProviderProfile(name="myrelay", error_rules=(ErrorRule("source_dead", codes=("NO_CREDIT",)),))``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from polygateway.ports import ErrorRule, ProviderProfile


def deepseek_thinking_body(enabled: bool) -> Mapping[str, Any]:
    """DeepSeek (also Zhipu GLM-4.5+, Doubao): top-level ``thinking: {"type": ...}``."""
    return {"thinking": {"type": "enabled" if enabled else "disabled"}}


def qwen_thinking_body(enabled: bool) -> Mapping[str, Any]:
    """Qwen / DashScope compatible mode: top-level ``enable_thinking``."""
    return {"enable_thinking": enabled}


OPENAI = ProviderProfile(name="openai", supports_native_schema=True)
"""OpenAI: ``response_format`` with ``json_schema`` works; no on/off thinking switch."""

DEEPSEEK = ProviderProfile(
    name="deepseek",
    thinking_body=deepseek_thinking_body,
    # 402 "Insufficient Balance" (code "invalid_request_error", type "unknown_error"): out of
    # credit. A relay that changes the status but keeps the message is caught by the common
    # "insufficient balance" rule.
    error_rules=(ErrorRule("source_dead", statuses=(402,)),),
)

QWEN = ProviderProfile(
    name="qwen",
    thinking_body=qwen_thinking_body,
    # DashScope answers 400 to a non-streaming call with thinking on.
    thinking_requires_stream=True,
    # 400 code/type "Arrearage" ("Access denied, please make sure your account is in good
    # standing."): the account is in arrears, not the request wrong.
    error_rules=(ErrorRule("source_dead", codes=("Arrearage",)),),
)

ZHIPU = ProviderProfile(
    name="zhipu",
    thinking_body=deepseek_thinking_body,
    # Business codes inside a 429 (docs.z.ai "API codes"): 1113 the account is in arrears /
    # balance exhausted, 1110-1112 and 1121 an inactive, missing or locked account. All of them
    # need someone to act; only 1302/1303/1305 (concurrency, frequency, overload) are rate limits.
    error_rules=(ErrorRule("source_dead", codes=("1110", "1111", "1112", "1113", "1121")),),
)
"""Zhipu / Z.ai GLM (OpenAI-compatible ``/api/paas/v4``): ``thinking: {"type": ...}``."""

GENERIC = ProviderProfile(name="generic")
"""Any other OpenAI-compatible endpoint: no extra body fields, default reasoning parsing."""

BUILTIN_PROFILES: tuple[ProviderProfile, ...] = (OPENAI, DEEPSEEK, QWEN, ZHIPU, GENERIC)


def builtin_profiles_by_name() -> dict[str, ProviderProfile]:
    """A fresh ``name -> profile`` mapping of the built-in profiles."""
    return {profile.name: profile for profile in BUILTIN_PROFILES}


__all__ = [
    "BUILTIN_PROFILES",
    "DEEPSEEK",
    "GENERIC",
    "OPENAI",
    "QWEN",
    "ZHIPU",
    "builtin_profiles_by_name",
    "deepseek_thinking_body",
    "qwen_thinking_body",
]
