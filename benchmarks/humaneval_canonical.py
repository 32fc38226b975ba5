"""The HumanEval canonical solutions through the ``python_tests`` kind, in the real process
sandbox (bwrap): what fraction of the 164 pass every test (the kind's own false-failure
rate, since every canonical solution is correct), and the per-problem wall time.

    .venv/bin/python benchmarks/humaneval_canonical.py --json [--limit N] [--concurrency 2]

Prints one JSON object: ``problems``, ``passed`` (all tests pass), ``pass_rate``,
``mean_reward``, ``failed`` (ids with their first non-passing test), ``p50_s`` / ``wall_s``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import trio

from streamrl.domains.kinds import Record
from streamrl.domains.kinds.humaneval import load_humaneval
from streamrl.domains.kinds.pytests import PythonTests
from streamrl.sandbox import ProcessSandbox, opened


async def run(limit: int, concurrency: int) -> dict[str, object]:
    items, verifier = load_humaneval()[:limit], PythonTests()
    rewards: dict[str, float] = {}
    failed: dict[str, str] = {}
    times: list[float] = []
    box = ProcessSandbox(uid_base=320_000)
    limiter = trio.CapacityLimiter(concurrency)

    async def one(item: Record) -> None:
        async with limiter:
            completion = str(item.extra["canonical_solution"])
            request = verifier.exec_request(item, completion)
            assert request is not None
            started = time.monotonic()
            result = await box.run(request)
            times.append(time.monotonic() - started)
            rewards[item.id] = verifier.score(item, completion, result)
            if rewards[item.id] < 1.0:
                bad = [r for r in verifier.test_results(item, completion, result)
                       if r.status != "pass"]
                failed[item.id] = (f"{bad[0].status}: {bad[0].name}: {bad[0].message[-200:]}"
                                   if bad else f"no report (exit {result.exit_code})")

    started = time.monotonic()
    async with opened(box), trio.open_nursery() as nursery:  # the warm pool, closed after
        for item in items:
            nursery.start_soon(one, item)
    passed = sum(1 for r in rewards.values() if r == 1.0)
    return {"problems": len(items), "passed": passed, "pass_rate": passed / len(items),
            "mean_reward": sum(rewards.values()) / len(items), "failed": failed,
            "p50_s": statistics.median(times), "wall_s": time.monotonic() - started,
            "concurrency": concurrency}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true", help="print JSON (the only output)")
    parser.add_argument("--limit", type=int, default=164)
    parser.add_argument("--concurrency", type=int, default=2)
    args = parser.parse_args()
    print(json.dumps(trio.run(run, args.limit, args.concurrency), indent=None if args.json else 2))


if __name__ == "__main__":
    main()
