"""What an attempt's error means for the call, and how long to wait before the next one.

ARCHITECTURE §6, §7.2. The error class of a failed attempt decides the next step:

| error                | next step                                    | breaker           |
|----------------------|----------------------------------------------|-------------------|
| TransientError       | backoff (max with Retry-After), switch       | failure           |
| SourceDeadError      | switch at once, source excluded for the call | force open        |
| RequestRejectedError | raise                                        | not counted       |
| ResultInvalidError   | raise                                        | success           |
| CancelledError       | propagate; permit and probe released         | probe handed back |

(The breaker column is applied by ``admission``; the loop in ``governor`` applies the rest.)
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence

from polygateway.errors import AllSourcesExhausted, ScopeUnavailableError
from polygateway.governance.cooldowns import CooldownMemo
from polygateway.ports import ProviderGate
from polygateway.settings import RetrySettings

__all__ = [
    "Backoff",
    "exhausted_error",
    "noted",
    "reasons_report",
    "retry_after_hint",
    "scope_retry_after",
]


class Backoff:
    """ARCHITECTURE §7.2: ``min(base * 2^n, max) * uniform(0.5, 1.5)`` before retry ``n``."""

    __slots__ = ("_base_s", "_max_s", "_rng")

    def __init__(self, retry: RetrySettings, rng: random.Random) -> None:
        self._base_s = retry.base_delay_s
        self._max_s = retry.max_delay_s
        self._rng = rng

    def delay(self, retry_index: int) -> float:
        """The jittered wait before retry ``retry_index`` (0 = the first retry)."""
        return self.floor(retry_index) * self._rng.uniform(0.5, 1.5)

    def floor(self, retry_index: int) -> float:
        """The un-jittered step: the least a caller should wait after retry ``retry_index``."""
        return float(min(self._base_s * 2.0 ** min(retry_index, 64), self._max_s))


def retry_after_hint(retry_after_s: float | None) -> float | None:
    """A usable Retry-After (finite, > 0), or ``None``."""
    if retry_after_s is not None and 0.0 < retry_after_s < math.inf:
        return retry_after_s
    return None


def noted(reasons: dict[str, str] | None, name: str, reason: str) -> dict[str, str]:
    """``reasons`` with ``name -> reason`` set (allocated on the first failure of a call)."""
    if reasons is None:
        return {name: reason}
    reasons[name] = reason
    return reasons


def reasons_report(
    names: Sequence[str], memo: CooldownMemo, reasons: Mapping[str, str] | None
) -> dict[str, str]:
    """Per-source reasons of this call, plus ``cooldown`` for sources skipped by the memo
    (``source_dead`` for one the memo holds as dead: a revoked key stays a dead source on
    later calls, not a transient cooldown)."""
    report = dict(reasons) if reasons else {}
    for name, (_, why) in memo.cooling(names).items():
        report.setdefault(name, "source_dead" if why == "source_dead" else "cooldown")
    return report


async def scope_retry_after(
    names: Sequence[str], memo: CooldownMemo, breaker: ProviderGate
) -> float:
    """Seconds until some source may take a new call: per source the later of the local
    cooldown and its breaker's reopening, then the minimum over sources."""
    cooling = memo.cooling(names)
    best = math.inf
    for name in names:
        local = cooling[name][0] if name in cooling else 0.0
        wait = max(local, await breaker.retry_after_s((name,)))
        if wait < best:
            best = wait
            if best <= 0.0:
                break
    return 0.0 if best == math.inf else best


async def exhausted_error(
    attempts: int,
    reasons: Mapping[str, str] | None,
    last_error: BaseException,
    *,
    names: Sequence[str],
    memo: CooldownMemo,
    breaker: ProviderGate,
    backoff: Backoff,
) -> ScopeUnavailableError:
    """The error of a call whose attempt budget is spent."""
    # Never "retry at once" after a spent budget: at least the next backoff step.
    floor = backoff.floor(attempts - 1)
    return AllSourcesExhausted(
        f"{attempts} attempt(s) failed; last error: {type(last_error).__name__}: {last_error}",
        retry_after_s=max(floor, await scope_retry_after(names, memo, breaker)),
        reason="retry_exhausted",
        per_source_reasons=reasons_report(names, memo, reasons),
        last_error=last_error,
    )
