"""OpenAI-style chat requests -> Anthropic Messages request bodies (pure, no I/O).

- ``system`` / ``developer`` messages anywhere are hoisted, in order, into the top-level
  ``system`` (a string when there is one text, else text blocks);
- content parts: ``text`` -> text block; ``image_url`` with a base64 data URL -> an ``image``
  block with a ``base64`` source, with an http(s) URL -> an ``image`` block with a ``url``
  source; any other part type is refused naming it;
- assistant ``tool_calls`` -> ``tool_use`` blocks (arguments parsed from their JSON string);
  ``role: tool`` messages -> ``tool_result`` blocks in a user turn;
- consecutive messages of the same role merge into one turn (tool results of one assistant
  turn must arrive together);
- OpenAI tool definitions / ``tool_choice`` in ``extra_body`` -> Anthropic ``tools`` /
  ``tool_choice``; ``max_completion_tokens`` -> ``max_tokens``.

Every problem is a ``RequestRejectedError`` naming the message index and what is wrong.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from polygateway.errors import RequestRejectedError
from polygateway.types import Message

SYSTEM_ROLES = frozenset(("system", "developer"))

_IMAGE_MEDIA_TYPES = frozenset(("image/jpeg", "image/png", "image/gif", "image/webp"))


def _reject(message: str, source_name: str | None) -> RequestRejectedError:
    return RequestRejectedError(message, source_name=source_name)


def _image_block(part: Mapping[str, Any], where: str, source_name: str | None) -> dict[str, Any]:
    image = part.get("image_url")
    url = image.get("url") if isinstance(image, Mapping) else image
    if not isinstance(url, str) or not url:
        raise _reject(f"{where}: image_url part without a url", source_name)
    if url.startswith("data:"):
        header, sep, data = url[5:].partition(",")
        media_type, _, encoding = header.partition(";")
        if not sep or encoding != "base64":
            raise _reject(
                f"{where}: image data URL must be base64 (data:<type>;base64,...)", source_name
            )
        if media_type not in _IMAGE_MEDIA_TYPES:
            raise _reject(
                f"{where}: image type {media_type!r} is not supported by the Messages API "
                f"(supported: {', '.join(sorted(_IMAGE_MEDIA_TYPES))})",
                source_name,
            )
        return {
            "type": "image",
            "source": {"type": "base64", "media_type": media_type, "data": data},
        }
    if url.startswith(("http://", "https://")):
        return {"type": "image", "source": {"type": "url", "url": url}}
    raise _reject(
        f"{where}: image url must be a data URL or http(s), got {url[:16]!r}...", source_name
    )


def _keep_cache_control(part: Mapping[str, Any], block: dict[str, Any]) -> dict[str, Any]:
    """A prompt-cache breakpoint on the part (``cache_control``) stays on its block."""
    if "cache_control" in part:
        block["cache_control"] = part["cache_control"]
    return block


def _plain_text(blocks: list[dict[str, Any]]) -> str | None:
    """The text of a lone plain text block (sent as a string), else ``None``."""
    if len(blocks) == 1 and blocks[0].keys() == {"type", "text"} and blocks[0]["type"] == "text":
        text: str = blocks[0]["text"]
        return text
    return None


def content_blocks(
    content: Any, where: str, source_name: str | None = None
) -> list[dict[str, Any]]:
    """The Anthropic blocks of one OpenAI ``content`` (a string or a list of parts)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    if content is None:
        return []
    if not isinstance(content, Sequence):
        raise _reject(f"{where}: content must be a string or a list of parts", source_name)
    blocks: list[dict[str, Any]] = []
    for index, part in enumerate(content):
        at = f"{where} part {index}"
        if not isinstance(part, Mapping):
            raise _reject(f"{at}: a part must be an object", source_name)
        kind = part.get("type")
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise _reject(f"{at}: text part without a string 'text'", source_name)
            if text:
                blocks.append(_keep_cache_control(part, {"type": "text", "text": text}))
        elif kind == "image_url":
            blocks.append(_keep_cache_control(part, _image_block(part, at, source_name)))
        elif kind in ("image", "tool_use", "tool_result", "document", "thinking"):
            blocks.append(dict(part))  # already an Anthropic block: passed through
        else:
            raise _reject(
                f"{at}: part type {kind!r} cannot be sent to the Messages API "
                "(text and image_url parts can)",
                source_name,
            )
    return blocks


def _system_text(content: Any, where: str, source_name: str | None) -> list[dict[str, Any]]:
    blocks = content_blocks(content, where, source_name)
    for block in blocks:
        if block.get("type") != "text":
            raise _reject(f"{where}: a system message may only hold text", source_name)
    return blocks


def _tool_use_blocks(calls: Any, where: str, source_name: str | None) -> list[dict[str, Any]]:
    if not isinstance(calls, Sequence) or isinstance(calls, str):
        raise _reject(f"{where}: tool_calls must be a list", source_name)
    blocks: list[dict[str, Any]] = []
    for index, call in enumerate(calls):
        at = f"{where} tool_calls[{index}]"
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(call.get("id"), str):
            raise _reject(f"{at}: needs an 'id' and a 'function' object", source_name)
        arguments = function.get("arguments") or "{}"
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            raise _reject(f"{at}: arguments are not valid JSON", source_name) from None
        if not isinstance(parsed, Mapping):
            raise _reject(f"{at}: arguments must be a JSON object", source_name)
        blocks.append(
            {"type": "tool_use", "id": call["id"], "name": function.get("name"), "input": parsed}
        )
    return blocks


def _tool_result_block(message: Message, where: str, source_name: str | None) -> dict[str, Any]:
    tool_call_id = message.get("tool_call_id")
    if not isinstance(tool_call_id, str) or not tool_call_id:
        raise _reject(f"{where}: a tool message needs a 'tool_call_id'", source_name)
    content = message.get("content")
    block: dict[str, Any] = {"type": "tool_result", "tool_use_id": tool_call_id}
    if isinstance(content, str):
        block["content"] = content
    else:
        block["content"] = content_blocks(content, where, source_name)
    return block


def convert_messages(
    messages: Sequence[Message], *, source_name: str | None = None
) -> tuple[str | list[dict[str, Any]] | None, list[dict[str, Any]]]:
    """``(system, messages)`` of the Anthropic body for OpenAI-style ``messages``."""
    system: list[dict[str, Any]] = []
    turns: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, Mapping):
            raise _reject(f"{where}: a message must be an object", source_name)
        role = message.get("role")
        if role in SYSTEM_ROLES:
            system.extend(_system_text(message.get("content"), where, source_name))
            continue
        if role == "user":
            blocks = content_blocks(message.get("content"), where, source_name)
        elif role == "assistant":
            blocks = content_blocks(message.get("content"), where, source_name)
            if message.get("tool_calls"):
                blocks += _tool_use_blocks(message["tool_calls"], where, source_name)
        elif role == "tool":
            role = "user"
            blocks = [_tool_result_block(message, where, source_name)]
        else:
            raise _reject(
                f"{where}: role {role!r} is not one of system, developer, user, assistant, tool",
                source_name,
            )
        if not blocks:
            raise _reject(f"{where}: {role} message has no content", source_name)
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"].extend(blocks)
        else:
            turns.append({"role": role, "content": blocks})
    if not turns:
        raise _reject("messages must hold at least one user or assistant message", source_name)
    # A lone text turn goes as a plain string: the common case, byte-compact.
    for turn in turns:
        text = _plain_text(turn["content"])
        if text is not None:
            turn["content"] = text
    if not system:
        return None, turns
    text = _plain_text(system)
    return (system if text is None else text), turns


def convert_tools(tools: Any, *, source_name: str | None = None) -> list[dict[str, Any]]:
    """OpenAI ``tools`` (``{"type": "function", "function": {...}}``) -> Anthropic tools;
    entries already in Anthropic form (``name`` + ``input_schema``, or a server tool with a
    ``type`` other than ``function``) pass through."""
    if not isinstance(tools, Sequence) or isinstance(tools, str):
        raise _reject("extra_body 'tools' must be a list", source_name)
    converted: list[dict[str, Any]] = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise _reject(f"tools[{index}]: a tool must be an object", source_name)
        if tool.get("type") != "function":
            converted.append(dict(tool))
            continue
        function = tool.get("function")
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise _reject(f"tools[{index}]: a function tool needs function.name", source_name)
        entry: dict[str, Any] = {
            "name": function["name"],
            "input_schema": function.get("parameters") or {"type": "object", "properties": {}},
        }
        if function.get("description"):
            entry["description"] = function["description"]
        converted.append(entry)
    return converted


def convert_tool_choice(choice: Any, *, source_name: str | None = None) -> dict[str, Any]:
    """OpenAI ``tool_choice`` -> Anthropic: ``auto``, ``none``, ``required`` -> ``any``, a named
    function -> ``{"type": "tool", "name": ...}``; an Anthropic-shaped object passes through."""
    if choice in ("auto", "none"):
        return {"type": choice}
    if choice == "required":
        return {"type": "any"}
    if isinstance(choice, Mapping):
        function = choice.get("function")
        if choice.get("type") == "function" and isinstance(function, Mapping):
            return {"type": "tool", "name": function.get("name")}
        if choice.get("type") in ("auto", "any", "tool", "none"):
            return dict(choice)
    raise _reject(f"tool_choice {choice!r} cannot be expressed in the Messages API", source_name)


def apply_extra_body(
    body: dict[str, Any], extra: Mapping[str, Any], *, source_name: str | None = None
) -> None:
    """Merge the request's ``extra_body`` into ``body``, converting the OpenAI-only fields."""
    for key, value in extra.items():
        if key == "tools":
            body["tools"] = convert_tools(value, source_name=source_name)
        elif key == "tool_choice":
            body["tool_choice"] = convert_tool_choice(value, source_name=source_name)
        elif key == "max_completion_tokens":
            body["max_tokens"] = value
        elif key == "stop":
            body["stop_sequences"] = [value] if isinstance(value, str) else list(value)
        else:
            body[key] = value


__all__ = [
    "SYSTEM_ROLES",
    "apply_extra_body",
    "content_blocks",
    "convert_messages",
    "convert_tool_choice",
    "convert_tools",
]
