"""PolyGateway transport ``openai-sdk``: chat completions through the official ``openai``
``AsyncOpenAI`` client, behind the same governance as ``openai-compat``.

Entry point ``polygateway: openai_sdk``. Select it per source with
``{SCOPE}__{P}__{N}__TRANSPORT=openai-sdk``. The SDK is imported when a source uses it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from polygateway.hookspecs import hookimpl
from polygateway.ports import ProviderProfile, Register
from polygateway.settings import SourceConfig


@hookimpl
def pgw_register_transports(register: Register) -> None:
    def openai_sdk(source: SourceConfig, providers: Mapping[str, ProviderProfile]) -> Any:
        from pgw_openai_sdk.transport import OpenAISDKTransport

        return OpenAISDKTransport(source, providers=providers)

    register("openai-sdk", openai_sdk)
