"""Chat messages are checked before anything digests or sends them.

``check_message_shape`` runs in ``GatewayClient.chat`` (before any layer: the cache and the
telemetry layer digest the messages); ``check_message_fields`` runs in the dispatcher, so a
request that a wrapping layer derived (a structured re-ask) is checked too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from polygateway.errors import RequestRejectedError

__all__ = ["check_message_fields", "check_message_shape"]


def check_message_shape(messages: object) -> None:
    """Refuse anything that is not a non-empty list of mappings (before any layer digests it)."""
    if type(messages) is not list and not isinstance(messages, list | tuple):
        raise RequestRejectedError(
            f"messages must be a non-empty list of message mappings, got {type(messages).__name__}"
        )
    if not messages:
        raise RequestRejectedError("messages is empty: at least one message is required")
    for index, message in enumerate(messages):
        # ``type() is dict`` first: the usual message, without the ABC machinery.
        if type(message) is not dict and not isinstance(message, Mapping):
            raise RequestRejectedError(
                f"messages[{index}] must be a mapping with 'role' and 'content', "
                f"got {type(message).__name__}"
            )


def check_message_fields(messages: Sequence[Mapping[str, Any]]) -> None:
    """Refuse messages without a ``role`` string or with a ``content`` of the wrong type."""
    for index, message in enumerate(messages):
        role = message.get("role")
        if not isinstance(role, str) or not role:
            if role is None:
                raise RequestRejectedError(f"messages[{index}] has no 'role'")
            raise RequestRejectedError(
                f"messages[{index}]['role'] must be a non-empty string, got {role!r}"
            )
        if "content" not in message:
            raise RequestRejectedError(f"messages[{index}] has no 'content'")
        content = message["content"]
        if type(content) is str or isinstance(content, str | list | tuple):
            continue
        # An assistant turn that only carries tool calls has ``content: null`` (OpenAI format).
        if content is None and role == "assistant":
            continue
        raise RequestRejectedError(
            f"messages[{index}]['content'] must be a string or a list of content parts, "
            f"got {type(content).__name__}"
        )
