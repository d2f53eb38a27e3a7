"""PolyGateway transport ``anthropic``: the Anthropic Messages API behind the same governance.

Entry point ``polygateway: anthropic``. Registers the transport ``anthropic`` (select it per
source with ``{SCOPE}__{P}__{N}__TRANSPORT=anthropic``) and the provider profile ``anthropic``
(its thinking switch). Implementations are imported when a factory runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from polygateway.hookspecs import hookimpl
from polygateway.ports import ProviderProfile, Register
from polygateway.settings import SourceConfig


@hookimpl
def pgw_register_transports(register: Register) -> None:
    def anthropic(source: SourceConfig, providers: Mapping[str, ProviderProfile]) -> Any:
        from pgw_anthropic.transport import AnthropicTransport

        return AnthropicTransport(source, providers=providers)

    register("anthropic", anthropic)


@hookimpl
def pgw_register_providers(register: Register) -> None:
    from pgw_anthropic.profile import ANTHROPIC_PROFILE

    register(ANTHROPIC_PROFILE.name, ANTHROPIC_PROFILE)
