"""Governance of one call of any kind: the generic attempt loop (no chat types in here).

A call kind writes ``attempt(source, call_id) -> Attempted[T]`` and hands it to
``Governor.run``; the governor owns source selection, the cooldown memo, the breaker gate and
its probe, admission through the limiter (global + source), settling the TPM charge, what each
error class means, backoff with jitter and Retry-After, source switching, the stall verdict,
``AllSourcesExhausted`` / ``CircuitOpenError`` and cancellation. ``docs/plugins.md`` ("Writing
a new call kind") shows a whole call kind.

- ``governor``: ``Governor`` and the loop;
- ``admission``: one attempt under the breaker gate and a permit, and the accounting;
- ``decisions``: error class -> next step, backoff, Retry-After, the exhausted error;
- ``cooldowns``: the cooldown memo (with the reason a source is shut);
- ``stall``: the verdict of a round in which no source admitted the attempt.
"""

from __future__ import annotations

from polygateway.governance.attempts import Attempt, Attempted, AttemptObserver, Outcome
from polygateway.governance.cooldowns import BREAKER_REASONS, CooldownMemo
from polygateway.governance.decisions import Backoff
from polygateway.governance.governor import Governor, governor_problems

__all__ = [
    "BREAKER_REASONS",
    "Attempt",
    "AttemptObserver",
    "Attempted",
    "Backoff",
    "CooldownMemo",
    "Governor",
    "Outcome",
    "governor_problems",
]
