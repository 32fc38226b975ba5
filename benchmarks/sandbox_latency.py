"""Claim: ProcessSandbox adds little to a bare subprocess. JSON out, baseline in the same run.

Runs ``python3 -c "print(1)"`` N times as a bare trio subprocess and through ProcessSandbox
(each isolation mode that works here) at concurrency 1, 2 and 8; prints p50/p99 in ms.
Simplification: wall time per call as seen by the caller, no warm-up beyond 3 calls.

    .venv/bin/python benchmarks/sandbox_latency.py [--runs 60]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Awaitable, Callable

import trio

from sandbox import ExecRequest, ProcessSandbox, SandboxUnavailable

ARGV = ["/usr/bin/python3", "-c", "print(1)"]


async def measure(call: Callable[[], Awaitable[object]], runs: int, concurrency: int) -> dict:
    for _ in range(3):
        await call()
    latencies: list[float] = []
    todo = iter(range(runs))

    async def worker() -> None:
        for _ in todo:
            start = time.perf_counter()
            await call()
            latencies.append((time.perf_counter() - start) * 1000)

    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker)
    cuts = statistics.quantiles(latencies, n=100)
    return {"p50_ms": round(cuts[49], 2), "p99_ms": round(cuts[98], 2), "runs": runs}


async def main(runs: int) -> None:
    async def bare() -> object:
        return await trio.run_process(ARGV, capture_stdout=True, capture_stderr=True)

    subjects: dict[str, Callable[[], Awaitable[object]]] = {"bare": bare}
    for mode in ("bwrap", "unshare", "none"):
        try:
            box = ProcessSandbox(isolation=mode)  # type: ignore[arg-type]
        except SandboxUnavailable:
            continue
        subjects[f"sandbox-{mode}"] = lambda box=box: box.run(ExecRequest(ARGV))
    report = {
        name: {str(c): await measure(call, runs, c) for c in (1, 2, 8)}
        for name, call in subjects.items()
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=60)
    trio.run(main, parser.parse_args().runs)
