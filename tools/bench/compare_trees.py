"""Before/after overhead of two checkouts, interleaved in one run, against one upstream.

    python tools/bench/compare_trees.py BEFORE_TREE AFTER_TREE [--rounds 5] [--seconds 1.5]

Each tree needs its own venv (``TREE/.venv``) with its ``polygateway-core`` installed. One
fake upstream (``pgw fake-upstream`` of the first tree) serves both. Every round runs, for
each tree in turn (the order alternates between rounds), a child process of that tree's
python that measures the governed client (memory limiter and breaker, no telemetry, no cache)
and the full pipeline (SQLite telemetry, memory cache, structured layer) with
``tools/bench/overhead.py``'s own ``bench_governed`` on its default engine, at concurrency 1
and 64, streaming and JSON. The child reports calls/s and client CPU µs per call; the medians
over the rounds are printed side by side with the after/before ratio (CPU) per point, and the
least CPU per call each tree needed in any round (on a shared machine the least contended
sample is the closest to the code's own cost).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import asyncio, importlib.util, json, sys
spec = importlib.util.spec_from_file_location("overhead", sys.argv[1])
overhead = importlib.util.module_from_spec(spec)
sys.modules["overhead"] = overhead  # its dataclasses look their module up
spec.loader.exec_module(overhead)
url, seconds, calls = sys.argv[2], float(sys.argv[3]), int(sys.argv[4])

async def main():
    out = []
    engine = overhead.default_engine()
    for stream in (True, False):
        for conc in (1, 64):
            load = overhead.Load(calls if conc > 1 else max(50, calls // 8), conc, seconds)
            for name, extra in (
                ("governed", {}),
                ("full-pipeline", {"telemetry": "sqlite", "cache": "memory"}),
            ):
                rate, cpu, note = await overhead.bench_governed(
                    url, stream, load, engine=engine, **extra
                )
                out.append([name, "stream" if stream else "json", conc, rate, cpu, note])
    print(json.dumps(out))

asyncio.run(main())
"""


def run_child(tree: Path, url: str, seconds: float, calls: int) -> list[list[object]]:
    python = tree / ".venv" / "bin" / "python"
    script = tree / "tools" / "bench" / "overhead.py"
    done = subprocess.run(
        [str(python), "-c", CHILD, str(script), url, str(seconds), str(calls)],
        check=False,
        capture_output=True,
        text=True,
        cwd=tree,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{tree}: the measuring child failed:\n{done.stderr[-3000:]}")
    result: list[list[object]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=1.5)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--chunks", type=int, default=20)
    args = parser.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import overhead  # the upstream helpers only (no polygateway import)

    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    port = overhead.free_port()
    # The first tree's fake upstream serves both trees.
    env_python = trees["before"] / ".venv" / "bin" / "python"
    saved = sys.executable
    sys.executable = str(env_python)
    try:
        upstream = overhead.start_upstream(port, args.chunks)
    finally:
        sys.executable = saved
    url = f"http://127.0.0.1:{port}/v1"
    print(f"nproc {os.cpu_count()}, load average {os.getloadavg()}", flush=True)
    samples: dict[tuple[str, str, str, int], list[tuple[float, float, str]]] = {}
    try:
        for round_no in range(args.rounds):
            order = ["before", "after"] if round_no % 2 == 0 else ["after", "before"]
            for label in order:
                for name, mode, conc, rate, cpu, note in run_child(
                    trees[label], url, args.seconds, args.calls
                ):
                    key = (label, str(name), str(mode), int(str(conc)))
                    samples.setdefault(key, []).append(
                        (float(str(rate)), float(str(cpu)), str(note))
                    )
                print(f"round {round_no + 1} {label} done", flush=True)
    finally:
        upstream.terminate()
        upstream.wait(10)
    print(f"load average after: {os.getloadavg()}")
    print()
    print(
        "| client | mode | conc | before calls/s | after calls/s | before CPU µs/call "
        "| after CPU µs/call | min CPU before / after "
        "| after/before CPU (median of paired rounds) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    points = sorted({k[1:] for k in samples}, key=lambda k: (k[1] != "stream", k[0], k[2]))
    for name, mode, conc in points:
        before = samples[("before", name, mode, conc)]
        after = samples[("after", name, mode, conc)]
        ratios = [a[1] / b[1] for a, b in zip(after, before, strict=False) if b[1]]
        notes = {n for _, _, n in before + after if "LOST" in n}
        print(
            f"| {name} | {mode} | {conc} | {statistics.median(r for r, _, _ in before):.0f} "
            f"| {statistics.median(r for r, _, _ in after):.0f} "
            f"| {statistics.median(c for _, c, _ in before):.0f} "
            f"| {statistics.median(c for _, c, _ in after):.0f} "
            f"| {min(c for _, c, _ in before):.0f} / {min(c for _, c, _ in after):.0f} "
            f"| {statistics.median(ratios):.3f} ({' / '.join(f'{x:.2f}' for x in ratios)}) "
            f"{' '.join(sorted(notes))}|"
        )


if __name__ == "__main__":
    main()
