"""Background health probes: an open source is probed by a cheap request, not by a caller.

With ``{SCOPE}__BREAKER__HEALTH_PROBE`` on, a source whose breaker opens gets one background
task of this client. It sleeps until the breaker would admit again, then sends the call kind's
cheap request through the same admission as a call (breaker probe lease, limiter permit,
verdict), so the breaker decides who probes: with a shared (Redis) breaker one process of the
fleet holds the lease and the others only look at the gate until its verdict. A successful
probe closes the breaker and the task ends; a failed one re-opens it (for a longer cooldown)
and the task sleeps again. ``aclose`` cancels every task; a cancelled probe hands its lease
back and releases its permit (``Admission``), so nothing is left behind.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from polygateway.errors import GovernanceBackendError, SourceDeadError, TransientError
from polygateway.governance.admission import Admission
from polygateway.governance.attempts import Attempt, Outcome
from polygateway.ports import Clock, Denial, ProviderGate
from polygateway.settings import SourceConfig

__all__ = ["HealthProber"]

logger = logging.getLogger(__name__)


class HealthProber:
    """One background probe loop per open source of one governor."""

    __slots__ = (
        "_admission",
        "_breaker",
        "_clock",
        "_closed",
        "_poll_s",
        "_probe",
        "_sources",
        "_tasks",
    )

    def __init__(
        self,
        *,
        sources: Mapping[str, SourceConfig],
        admission: Admission,
        breaker: ProviderGate,
        probe: Attempt[Any],
        clock: Clock,
        poll_interval_s: float,
    ) -> None:
        self._sources = sources
        self._admission = admission
        self._breaker = breaker
        self._probe = probe
        self._clock = clock
        self._poll_s = poll_interval_s
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._closed = False

    @property
    def watching(self) -> frozenset[str]:
        """Sources with a probe loop running."""
        return frozenset(name for name, task in self._tasks.items() if not task.done())

    def watch(self, name: str) -> None:
        """Probe ``name`` in the background until its breaker closes (no-op when already)."""
        if self._closed:
            return
        task = self._tasks.get(name)
        if task is not None and not task.done():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop, no background work: calls probe as before
            return
        self._tasks[name] = loop.create_task(self._loop(name), name=f"pgw health probe {name}")

    async def aclose(self) -> None:
        """Cancel every probe loop and wait for them (leases handed back, permits released)."""
        self._closed = True
        tasks = [task for task in self._tasks.values() if not task.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()

    async def _loop(self, name: str) -> None:
        source = self._sources[name]
        breaker = self._breaker
        while True:
            try:
                wait = await breaker.retry_after_s([name])
                if wait > 0:
                    await self._clock.sleep(wait)
                    continue
                if await breaker.state(name) == "closed":
                    return  # a call (or another process) closed it meanwhile
                outcome = await self._admission.attempt(
                    source, source.est_tokens, self._probe, None, 1
                )
            except (TransientError, SourceDeadError, GovernanceBackendError) as exc:
                # The breaker has its verdict (or the backend is down): look again later.
                logger.debug("health probe of %s: %s: %s", name, type(exc).__name__, exc)
                await self._clock.sleep(self._poll_s)
                continue
            except Exception as exc:  # noqa: BLE001 - a probe never breaks the client
                # The source refuses the probe request itself: probing it again would only
                # repeat that, so calls find out as without background probes.
                logger.warning("health probe of %s stopped: %s: %s", name, type(exc).__name__, exc)
                return
            if isinstance(outcome, Outcome):
                logger.info("health probe of %s succeeded: the source serves again", name)
                return
            if isinstance(outcome, Denial):
                await self._clock.sleep(max(outcome.wait_s, self._poll_s))
            else:
                # Refused by the breaker: another process holds the probe lease (look again
                # soon for its verdict) or the source re-opened.
                wait = outcome.retry_after_s
                if outcome.state == "half_open":
                    wait = min(wait, self._poll_s)
                await self._clock.sleep(max(wait, 1e-3))
