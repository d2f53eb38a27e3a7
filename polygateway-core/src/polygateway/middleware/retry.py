"""Compatibility: ``RetryMiddleware`` is now ``polygateway.chat.ChatDispatcher`` on
``polygateway.governance.Governor``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from polygateway.chat.dispatcher import ChatDispatcher
from polygateway.chat.messages import check_message_fields, check_message_shape
from polygateway.ports import Handler
from polygateway.types import ChatRequest, LLMResponse

__all__ = ["RetryMiddleware", "check_message_fields", "check_message_shape"]


class RetryMiddleware:
    __slots__ = ("_dispatcher",)

    def __init__(self, **parts: Any) -> None:
        self._dispatcher = ChatDispatcher.create(**parts)

    @property
    def inflight(self) -> Mapping[str, int]:
        return self._dispatcher.governor.inflight

    async def __call__(self, request: ChatRequest, call_next: Handler) -> LLMResponse:
        return await self._dispatcher(request)
