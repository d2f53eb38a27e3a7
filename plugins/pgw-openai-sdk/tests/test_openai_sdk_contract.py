"""The shared transport contract suite, run against the ``openai-sdk`` transport."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
from pgw_openai_sdk.transport import HTTP_CLIENTS, OpenAISDKTransport
from polygateway.ports import Transport
from polygateway.settings import SourceConfig
from polygateway.testing.contracts.transport import TransportContract


class TestOpenAISDKContract(TransportContract):
    @pytest.fixture(params=HTTP_CLIENTS)
    def make_transport(self, request: pytest.FixtureRequest) -> Callable[[SourceConfig], Transport]:
        client = str(request.param)

        def make(source: SourceConfig) -> Transport:
            options = {**source.options, "engine": client}
            return OpenAISDKTransport(dataclasses.replace(source, options=options))

        return make
