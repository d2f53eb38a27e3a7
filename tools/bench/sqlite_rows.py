"""The SQLite recorder's writer: CPU per row as the table grows, by the form of ``call_id``.

    python tools/bench/sqlite_rows.py [--rows 200000] [--rounds 3] [--report-every 50000]

Writes ``--rows`` records through ``SQLiteRecorder`` (its writer thread, its batches) into a
fresh database, ``--rounds`` times per id form, interleaved, and reports this process's CPU
per row for each stretch of ``--report-every`` rows (medians over the rounds):

- ``time-ordered``: ``polygateway.ids.new_call_id`` (UUIDv7: milliseconds first), the ids the
  library makes;
- ``random``: 128 random bits (the UUID4 form the library used before), every row's key lands
  somewhere else in the primary key's index.

``root_call_id`` (indexed too) equals ``call_id``, as for a call of one attempt. The records
are made before the clock starts; what is timed is ``record_nowait`` plus the writer.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from collections.abc import Callable

from polygateway.ids import new_call_id
from polygateway.telemetry.sqlite import SQLiteRecorder
from polygateway.testing.contracts.telemetry import sample_record

ID_FORMS: dict[str, Callable[[], str]] = {
    "time-ordered": new_call_id,
    "random": lambda: os.urandom(16).hex(),
}


async def write_rows(make_id: Callable[[], str], rows: int, every: int) -> list[float]:
    """CPU µs per row of each stretch of ``every`` rows (recorded and written)."""
    records = [sample_record(call_id=make_id(), created_at=time.time()) for _ in range(rows)]
    per_row: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        recorder = SQLiteRecorder(os.path.join(tmp, "rows.db"))
        try:
            for start in range(0, rows, every):
                begun = time.process_time()
                for record in records[start : start + every]:
                    recorder.record_nowait(record)
                await recorder.flush()
                per_row.append((time.process_time() - begun) / every * 1e6)
        finally:
            await recorder.aclose()
        if recorder.dropped:
            raise SystemExit(f"{recorder.dropped} rows dropped")
    return per_row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--report-every", type=int, default=50_000)
    args = parser.parse_args()
    if args.rows % args.report_every:
        parser.error("--rows must be a multiple of --report-every")
    results: dict[str, list[list[float]]] = {name: [] for name in ID_FORMS}
    for _ in range(args.rounds):
        for name, make_id in ID_FORMS.items():
            results[name].append(asyncio.run(write_rows(make_id, args.rows, args.report_every)))
    stretches = args.rows // args.report_every
    header = " | ".join(
        f"rows {i * args.report_every:,}-{(i + 1) * args.report_every:,}" for i in range(stretches)
    )
    print(f"| call_id | {header} |")
    print("|---|" + "---:|" * stretches)
    for name, runs in results.items():
        medians = [statistics.median(run[i] for run in runs) for i in range(stretches)]
        print(f"| {name} | " + " | ".join(f"{m:.1f} µs" for m in medians) + " |")


if __name__ == "__main__":
    main()
