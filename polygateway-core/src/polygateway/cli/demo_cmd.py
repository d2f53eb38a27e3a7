"""``pgw demo``: the main job on embedded defaults, end to end, in about ten seconds.

Starts the fake upstream in-process with three sources (healthy but for a few requests it
rejects, flaky with 429/5xx, one with a dead key), runs a few hundred concurrent governed calls
with in-memory limiter, breaker and cache and SQLite telemetry, repeats prompts to hit the
cache, makes one structured call that needs a re-ask, then prints what happened, read back from
the telemetry database.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

ROLES = {"openai-1": "healthy", "qwen-1": "flaky (429/5xx)", "deepseek-1": "dead key (401)"}
REJECTED = 2
"""Requests the healthy source rejects (400): each fails its call at once (never retried)."""
PRICES: dict[str, Any] = {
    "currency": "USD",
    "demo-healthy": {"input_per_1m": 0.15, "output_per_1m": 0.60},
    "demo-flaky": {"input_per_1m": 0.10, "output_per_1m": 0.40},
    "demo-dead": {"input_per_1m": 0.20, "output_per_1m": 0.80},
}


def configure(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    parser.description = "Run a governed batch against an in-process fake upstream; summarize it."
    parser.add_argument("--calls", type=int, default=300, help="governed calls in the batch")
    parser.add_argument("--concurrency", type=int, default=32, help="calls in flight at once")
    parser.add_argument("--db", default="pgw_demo_telemetry.db", help="SQLite telemetry file")
    parser.add_argument(
        "--seed", type=int, default=7, help="seed of the prompts repeated to hit the cache"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return run


def run(args: argparse.Namespace) -> int:
    import asyncio
    import json
    import os
    import tempfile

    if args.calls < 20 or args.concurrency < 1:
        print("pgw demo: --calls must be >= 20 and --concurrency >= 1", file=sys.stderr)
        return 2
    for suffix in ("", "-wal", "-shm"):  # a fresh database per demo run
        if os.path.exists(args.db + suffix):
            os.remove(args.db + suffix)
    with tempfile.TemporaryDirectory() as tmp:
        pricing = os.path.join(tmp, "prices.json")
        with open(pricing, "w", encoding="utf-8") as fh:
            json.dump(PRICES, fh)
        return asyncio.run(_demo(args, pricing))


def _answer(request: dict[str, Any]) -> str:
    """Content of the fake's replies: plain text, or JSON for the structured call."""
    messages = request.get("messages") or []
    last = str(messages[-1].get("content", "")) if messages else ""
    if "invoice" in str(messages[0].get("content", "")).lower():
        if len(messages) >= 3:  # the re-ask: bad answer and feedback were appended
            return '{"number": "INV-42", "total": 99.5}'
        return '{"number": "INV-42", "total": "ninety-nine"}'  # fails validation once
    return f"Answer to: {last[:40]}"


class _TransitionLog:
    """A ProviderGate decorator that notes every state change it sees (for the summary)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.transitions: list[tuple[str, str, str]] = []
        self._last: dict[str, str] = {}

    def _note(self, source: str, state: str) -> None:
        before = self._last.get(source, "closed")
        if state != before:
            self.transitions.append((source, before, state))
        self._last[source] = state

    async def try_enter(self, source: str) -> Any:
        decision = await self._inner.try_enter(source)
        self._note(source, decision.state)
        return decision

    async def record_success(self, decision: Any) -> Any:
        update = await self._inner.record_success(decision)
        self._note(update.source, update.state)
        return update

    async def record_failure(self, decision: Any, **kwargs: Any) -> Any:
        update = await self._inner.record_failure(decision, **kwargs)
        self._note(update.source, update.state)
        return update

    async def force_open(self, source: str) -> Any:
        update = await self._inner.force_open(source)
        self._note(source, update.state)
        return update

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _progress(done: int, total: int, failed: int) -> None:
    """A bar redrawn in place on a terminal; a line per quarter otherwise (logs, CI)."""
    if sys.stderr.isatty():
        width = 40
        filled = int(width * done / total)
        sys.stderr.write(
            f"\r  [{'#' * filled}{'.' * (width - filled)}] {done}/{total}  failed {failed}"
        )
        if done == total:
            sys.stderr.write("\n")
    elif done == total or done % max(1, total // 4) == 0:
        sys.stderr.write(f"  {done}/{total} calls done, {failed} failed\n")
    sys.stderr.flush()


async def _demo(args: argparse.Namespace, pricing: str) -> int:
    import functools
    import random

    from pydantic import BaseModel

    from polygateway import GatewayClient, PolyGatewayError
    from polygateway.backends.memory.breaker import InMemoryGate
    from polygateway.clock import SystemClock
    from polygateway.telemetry.report import read_sqlite_rows
    from polygateway.testing import FakeUpstream, Reply

    class Invoice(BaseModel):
        number: str
        total: float

    rng = random.Random(args.seed)

    async with FakeUpstream() as fake:
        fake.script("healthy", *[Reply.error(400) for _ in range(REJECTED)])
        fake.set_default(
            "healthy", Reply.ok(content=_answer, first_token_delay=0.05, inter_token_delay=0.002)
        )
        # Flaky: scattered 429/503 (retried elsewhere) and one burst that opens its breaker,
        # which half-opens after the cooldown and closes again on a good probe.
        flaky: list[Any] = []
        for i in range(args.calls * 2):
            if 20 <= i < 25:
                flaky.append(Reply.error(503))
            elif i % 13 == 3:
                flaky.append(Reply.error(429, retry_after=0.1))
            elif i % 7 == 5:
                flaky.append(Reply.error(503))
            else:
                flaky.append(
                    Reply.ok(content=_answer, first_token_delay=0.08, inter_token_delay=0.004)
                )
        fake.script("flaky", *flaky)
        fake.set_default("dead", Reply.error(401))

        env = {
            "LLM__OPENAI__1__BASE_URL": fake.base_url("healthy"),
            "LLM__OPENAI__1__MODEL": "demo-healthy",
            "LLM__OPENAI__1__API_KEY": "sk-demo-healthy",
            "LLM__QWEN__1__BASE_URL": fake.base_url("flaky"),
            "LLM__QWEN__1__MODEL": "demo-flaky",
            "LLM__QWEN__1__API_KEY": "sk-demo-flaky",
            "LLM__DEEPSEEK__1__BASE_URL": fake.base_url("dead"),
            "LLM__DEEPSEEK__1__MODEL": "demo-dead",
            "LLM__DEEPSEEK__1__API_KEY": "sk-demo-revoked",
            "LLM__GLOBAL__MAX_CONCURRENCY": "24",
            # Room for the worst order the concurrent calls can meet the faults in (the dead
            # source, a 429 waited on, 503s on the flaky one with its same-source retry, then
            # the healthy one), so the demo's outcome does not depend on timing.
            "LLM__RETRY__MAX_ATTEMPTS": "8",
            "LLM__RETRY__BASE_DELAY_S": "0.05",
            "LLM__RETRY__MAX_DELAY_S": "0.5",
            "LLM__BREAKER__FAIL_THRESHOLD": "4",
            "LLM__BREAKER__COOLDOWN_S": "0.5",
            "LLM__OPENAI__1__TIMEOUT_S": "10",
            "LLM__QWEN__1__TIMEOUT_S": "10",
            "LLM__DEEPSEEK__1__TIMEOUT_S": "10",
            "LLM__STRUCTURED__MAX_RETRIES": "1",
            "PGW_CACHE_BACKEND": "memory",
            "PGW_CACHE_NAMESPACE": "demo",
            "PGW_CACHE_TTL_S": "600",
            "PGW_TELEMETRY_BACKEND": "sqlite",
            "PGW_TELEMETRY_SQLITE_PATH": args.db,
            "PGW_PRICING_PATH": pricing,
            "PGW_PLUGINS": "",
        }
        breaker = _TransitionLog(
            InMemoryGate(fail_threshold=4, cooldown_s=0.5, probe_ttl_s=20.0, clock=SystemClock())
        )
        client = GatewayClient.from_env(env=env, breaker=breaker)
        unique = args.calls - args.calls // 6
        prompts = [f"Summarize document #{i} in one line." for i in range(unique)]
        repeats = [prompts[rng.randrange(10)] for _ in range(args.calls - unique)]
        failures: dict[str, int] = {}
        done = 0

        async def one(prompt: str) -> None:
            nonlocal done
            try:
                await client.chat([{"role": "user", "content": prompt}])
            except PolyGatewayError as exc:
                failures[type(exc).__name__] = failures.get(type(exc).__name__, 0) + 1
            done += 1
            if not args.quiet:
                _progress(done, args.calls, sum(failures.values()))

        print(
            f"PolyGateway demo: {args.calls} calls, concurrency {args.concurrency}, "
            "3 sources (healthy, flaky, dead key); the healthy one rejects its first "
            f"{REJECTED} requests (400: the call fails, not retried)"
        )
        from polygateway import gather_bounded

        async with client:
            await gather_bounded([functools.partial(one, p) for p in prompts], args.concurrency)
            await gather_bounded([functools.partial(one, p) for p in repeats], args.concurrency)
            invoice = await client.chat(
                [{"role": "user", "content": "Extract the invoice as JSON: INV-42, 99.50"}],
                structured=Invoice,
            )
        rows = read_sqlite_rows(args.db)

    _summary(rows, args.calls + 1, failures, breaker.transitions, invoice, args.db)
    return 0


def _summary(
    rows: list[dict[str, Any]],
    calls: int,
    failures: dict[str, int],
    transitions: list[tuple[str, str, str]],
    invoice: Any,
    db: str,
) -> None:
    """Everything printed is computed: from the telemetry rows (the same totals ``pgw telemetry
    report`` prints for this database), the calls the demo made, and the breaker's log."""
    from polygateway.telemetry.report import build_report, fmt_ms, percentile, summary_lines

    report = build_report(rows, by="source", currency=str(PRICES["currency"]))
    print()
    print(f"{'source':12} {'role':18} {'attempts':>8} {'ok':>6} {'errors':>7}  top error")
    for group in report.groups:
        if group.key == "-":
            continue
        errs = report.errors_by_source.get(group.key)
        top = errs.most_common(1)[0][0] if errs else ""
        print(
            f"{group.key:12} {ROLES.get(group.key, ''):18} {group.attempts:>8} {group.ok:>6} "
            f"{group.failed_attempts:>7}  {top}"
        )
    total = report.total
    failed = sum(failures.values())
    print()
    print(f"calls made {calls}: {calls - failed} answered, {failed} failed {failures or ''}")
    print("from the telemetry database (what `pgw telemetry report` prints for it):")
    for line in summary_lines(report):
        print(f"  {line}")
    print(f"  cache hit rate {total.cache_hits / max(1, total.answered):.0%} of answered calls")
    print(
        f"  latency p50 {fmt_ms(percentile(total.latencies, 50))}, p95 "
        f"{fmt_ms(percentile(total.latencies, 95))}; TTFT p50 "
        f"{fmt_ms(percentile(total.ttfts, 50))}, p95 {fmt_ms(percentile(total.ttfts, 95))}"
    )
    print(f"breaker transitions: {len(transitions)}")
    for source in dict.fromkeys(s for s, _, _ in transitions):
        states = [before for s, before, _ in transitions if s == source]
        states.append([after for s, _, after in transitions if s == source][-1])
        print(f"  {source}: {' -> '.join(states)}")
    reasks = report.errors_by_class.get("ResultInvalidError", 0)
    times = "once" if reasks == 1 else f"{reasks} times"
    after = f"re-asked {times} after a validation error" if reasks else "valid at once"
    print(f"structured call: {invoice.structured_data!r} ({after})")
    print(f"\nEvery attempt is in {db}: try  pgw telemetry report --db {db} --by source")
