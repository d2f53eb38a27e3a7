"""Source selection strategies (``ports.SourceSelector``, D6, ARCHITECTURE §7.7).

The retry layer hands a selector the runnable sources only (cooling, dead and refused sources
are already filtered out) and its local in-flight counts. Selectors are synchronous and keep
no state beyond a rotation counter, so one instance serves any number of concurrent calls.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence

from polygateway.settings import SourceConfig

__all__ = ["LeastInflightSelector", "PrioritySelector", "RoundRobinSelector", "WeightedSelector"]


def _require_sources(sources: Sequence[SourceConfig]) -> None:
    if not sources:
        raise ValueError("choose() needs at least one runnable source")


class RoundRobinSelector:
    """Takes the runnable sources in turn.

    The counter is shared by every call, so concurrent calls spread over the sources too.
    """

    __slots__ = ("_turn",)

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, sources: Sequence[SourceConfig], inflight: Mapping[str, int]) -> SourceConfig:
        count = len(sources)
        if count == 1:
            return sources[0]
        _require_sources(sources)
        turn = self._turn
        self._turn = turn + 1
        return sources[turn % count]

    def __repr__(self) -> str:
        return "RoundRobinSelector()"


class LeastInflightSelector:
    """Takes the source with the fewest attempts in flight from this client.

    Ties rotate (starting point moves on every choice), so idle sources share sequential
    calls instead of the first one taking them all.
    """

    __slots__ = ("_turn",)

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, sources: Sequence[SourceConfig], inflight: Mapping[str, int]) -> SourceConfig:
        count = len(sources)
        if count == 1:
            return sources[0]
        _require_sources(sources)
        start = self._turn % count
        self._turn = start + 1
        best = sources[start]
        best_load = inflight.get(best.name, 0)
        for offset in range(1, count):
            candidate = sources[(start + offset) % count]
            load = inflight.get(candidate.name, 0)
            if load < best_load:
                best, best_load = candidate, load
        return best

    def __repr__(self) -> str:
        return "LeastInflightSelector()"


def _rank(source: SourceConfig) -> float:
    return math.inf if source.priority is None else float(source.priority)


class PrioritySelector:
    """Takes the first runnable source in priority order: a primary and its fallbacks.

    Order: ``priority`` ascending (``{SCOPE}__{P}__{N}__PRIORITY`` or the file's
    ``priority``), then declared order; sources without a priority come after numbered ones.
    The governor hands over the runnable sources in declared order, and ``min`` keeps the
    first of equals, so ties resolve to the declared order.
    """

    __slots__ = ()

    def choose(self, sources: Sequence[SourceConfig], inflight: Mapping[str, int]) -> SourceConfig:
        if len(sources) == 1:
            return sources[0]
        _require_sources(sources)
        return min(sources, key=_rank)

    def __repr__(self) -> str:
        return "PrioritySelector()"


class WeightedSelector:
    """Takes a runnable source at random in proportion to its ``weight`` (default 1.0).

    ``rng`` is injectable so that tests see one sequence.
    """

    __slots__ = ("_rng",)

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng if rng is not None else random.Random()

    def choose(self, sources: Sequence[SourceConfig], inflight: Mapping[str, int]) -> SourceConfig:
        if len(sources) == 1:
            return sources[0]
        _require_sources(sources)
        point = self._rng.random() * math.fsum(s.weight for s in sources)
        for source in sources:
            point -= source.weight
            if point < 0:
                return source
        return sources[-1]  # rounding left a sliver at the end

    def __repr__(self) -> str:
        return "WeightedSelector()"
