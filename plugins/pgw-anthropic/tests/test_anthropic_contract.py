"""The shared transport contract suite, in its Messages API form, against the ``anthropic``
transport on every HTTP engine the core ships."""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable

import pytest
from pgw_anthropic.transport import AnthropicTransport
from polygateway.ports import Transport
from polygateway.settings import SourceConfig
from polygateway.testing.contracts.transport import TransportContract
from polygateway.transports.engines import ENGINE_NAMES

_OPTIONAL = {"httpx-aiohttp": "httpx_aiohttp", "httpx2": "httpx2"}
ENGINES = [
    name
    for name in ENGINE_NAMES
    if name not in _OPTIONAL or importlib.util.find_spec(_OPTIONAL[name]) is not None
]


class TestAnthropicContract(TransportContract):
    protocol = "anthropic"

    @pytest.fixture(params=ENGINES)
    def make_transport(self, request: pytest.FixtureRequest) -> Callable[[SourceConfig], Transport]:
        engine = str(request.param)

        def make(source: SourceConfig) -> Transport:
            options = {**source.options, "engine": engine}
            return AnthropicTransport(dataclasses.replace(source, options=options))

        return make
