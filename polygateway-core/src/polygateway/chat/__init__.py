"""Chat as one call kind on the governor: the dispatcher (the pinned endpoint) and the checks
of chat messages."""

from __future__ import annotations

from polygateway.chat.dispatcher import ChatDispatcher
from polygateway.chat.messages import check_message_fields, check_message_shape

__all__ = ["ChatDispatcher", "check_message_fields", "check_message_shape"]
