"""Reasoning inline in the answer: ``<think>...</think>`` at the start of the content, split
off incrementally (protocols §2) whatever the chunk boundaries."""

from __future__ import annotations

from collections.abc import Sequence

_START, _THINK = 0, 1
BODY = 2
"""``ThinkTagSplitter.mode`` once past any think block: every further text is content."""


def _held_suffix(text: str, tag: str) -> int:
    """Length of the longest proper prefix of ``tag`` that ``text`` ends with."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


class ThinkTagSplitter:
    """Separates an inline ``<think>...</think>`` block from the answer, incrementally.

    Only a block that opens the content (after optional whitespace) is recognised: a model
    quoting a tag mid-answer keeps its text. A closing tag without an opening one (original
    DeepSeek-R1) is not guessed at: the text stays content. Tags split across chunks are held
    back until they can be decided.
    """

    __slots__ = ("_close", "_pending", "_tags", "content", "found", "mode", "thinking")

    def __init__(self, tags: Sequence[tuple[str, str]] = (("<think>", "</think>"),)) -> None:
        self._tags = tags if type(tags) is tuple else tuple(tags)
        self.mode = _START if self._tags else BODY
        self._pending = ""
        self._close = ""
        self.content: list[str] = []
        self.thinking: list[str] = []
        self.found = False

    @property
    def has_text(self) -> bool:
        """Whether any content or thinking arrived (held-back tag prefixes included)."""
        return bool(self.content or self.thinking or self._pending)

    def feed(self, text: str) -> None:
        if self.mode == BODY:
            self.content.append(text)
            return
        if self._pending:
            text = self._pending + text
            self._pending = ""
        if self.mode == _START:
            stripped = text.lstrip()
            if not stripped:
                self._pending = text
                return
            for open_tag, close_tag in self._tags:
                if stripped.startswith(open_tag):
                    self.mode = _THINK
                    self._close = close_tag
                    self.found = True
                    text = stripped[len(open_tag) :]
                    break
            else:
                if any(tag.startswith(stripped) for tag, _ in self._tags):
                    self._pending = text  # maybe "<thi" of "<think>": decide later
                else:
                    self.mode = BODY
                    self.content.append(text)
                return
        # Inside the think block.
        close = self._close
        index = text.find(close)
        if index >= 0:
            if index:
                self.thinking.append(text[:index])
            self.mode = BODY
            rest = text[index + len(close) :]
            if rest:
                self.content.append(rest)
            return
        held = _held_suffix(text, close)
        if held:
            self._pending = text[-held:]
            text = text[:-held]
        if text:
            self.thinking.append(text)

    def finish(self) -> tuple[str, str]:
        """``(content, thinking)``; the answer after a think block loses its leading whitespace."""
        pending = self._pending
        self._pending = ""
        if pending:
            (self.thinking if self.mode == _THINK else self.content).append(pending)
        content = "".join(self.content)
        if self.found:
            content = content.lstrip()
        return content, "".join(self.thinking)


def split_think(
    text: str, tags: Sequence[tuple[str, str]] = (("<think>", "</think>"),)
) -> tuple[str, str]:
    """One-shot ``ThinkTagSplitter``: ``(content, thinking)`` of a complete text."""
    splitter = ThinkTagSplitter(tags)
    splitter.feed(text)
    return splitter.finish()


def opens_think_block(text: str, tags: Sequence[tuple[str, str]]) -> bool:
    """Whether ``text`` (after leading whitespace) starts with an opening tag: only then can
    ``split_think`` change it, so a complete answer without one skips the splitter."""
    stripped = text.lstrip()
    for open_tag, _ in tags:  # noqa: SIM110 - a plain loop: no generator per call
        if stripped.startswith(open_tag):
            return True
    return False


__all__ = ["BODY", "ThinkTagSplitter", "opens_think_block", "split_think"]
