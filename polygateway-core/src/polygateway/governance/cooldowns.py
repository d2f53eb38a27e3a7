"""The cooldown memo: sources this client knows to be shut, until when, and why.

ARCHITECTURE D6: skip sources known to be shut instead of burning a request on them. The memo
is local to one governor (one client) and shared by all its calls. It keeps the reason, because
the scope-level verdict differs: a source held shut by its breaker (``circuit_open``,
``source_dead``) makes ``CircuitOpenError`` territory, a rate-limited or transiently failing one
does not.
"""

from __future__ import annotations

from collections.abc import Iterable

from polygateway.ports import Clock

__all__ = ["BREAKER_REASONS", "CooldownMemo"]

BREAKER_REASONS = frozenset({"circuit_open", "source_dead"})
"""Cooldown reasons that mean "the breaker keeps this source shut"."""


class CooldownMemo(dict[str, tuple[float, str]]):
    """Source name -> (monotonic deadline, reason). Expired entries are dropped when seen.

    A ``dict`` so that "is anything cooling?" (asked on every call) is the C-level truth test
    of an empty mapping; write it only through ``cool`` and ``forget``.
    """

    __slots__ = ("_clock",)

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self._clock = clock

    def cool(self, name: str, seconds: float, reason: str) -> None:
        """Remember that ``name`` is shut for ``seconds`` (keeps the later deadline)."""
        if not seconds > 0:
            return
        deadline = self._clock.monotonic() + seconds
        entry = self.get(name)
        if entry is None or entry[0] < deadline:
            self[name] = (deadline, reason)

    def forget(self, name: str) -> None:
        """The source answered: whatever was remembered against it is stale."""
        self.pop(name, None)

    def blocks(self, name: str, now: float) -> bool:
        """Whether ``name`` is cooling at ``now``; an expired entry is dropped."""
        entry = self.get(name)
        if entry is None:
            return False
        if entry[0] > now:
            return True
        del self[name]
        return False

    def cooling(self, names: Iterable[str]) -> dict[str, tuple[float, str]]:
        """Remaining cooldown (seconds, reason) of each of ``names`` that is cooling now."""
        now = self._clock.monotonic()
        out: dict[str, tuple[float, str]] = {}
        for name in names:
            entry = self.get(name)
            if entry is not None and entry[0] > now:
                out[name] = (entry[0] - now, entry[1])
        return out

    def __repr__(self) -> str:
        return f"CooldownMemo({sorted(self)})"
