"""Verifications per second of the verifier's handler: scoring in a worker thread (the old
path, ``Verifier(scorers=None)``) against scoring in the pool of scorer processes
(:mod:`runtime.workers`, the path ``verifier.serve`` takes), on the same messages.

    .venv/bin/python benchmarks/verifier_throughput.py --json [--messages 400] [--group 4]

The messages are ``math`` groups (sympy equivalence: the heaviest built-in scorer without a
sandbox) handled ``--concurrency`` at a time, no Redis (the hand-off is the same for both).
Prints one JSON object: ``thread`` and ``pool`` with ``messages_per_s`` and ``p50_ms``.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

import structlog
import trio

from streamrl.actors.executor import to_outcome
from streamrl.actors.scheduler import make_task
from streamrl.actors.verifier import SCORER_PRELOAD, Verifier
from streamrl.domains.math import MathItem
from streamrl.protocol.messages import Executed, Rollout, Sample, Sampling, new_id, now
from streamrl.runtime.workers import open_worker_pool

TEXTS = ["Answer: 4", "Answer: 2*2", "so the answer is 5", "Answer: x"]


def executed(i: int, group: int) -> Executed:
    item = MathItem(id=str(i), prompt=f"What is {i}+4-{i}?", answer="4", kind="t")
    task = make_task("math", item, split="train", group_size=group, sampling=Sampling(),
                     version=0)
    samples = [Sample(tokens=b"\0" * 4, logprobs=b"\0" * 4, text=TEXTS[k % len(TEXTS)],
                      finish_reason="stop", weight_version=0) for k in range(group)]
    rollout = Rollout(id=new_id(), created_at=now(), policy_version=0, task=task,
                      prompt_ids=b"\0" * 4, samples=samples)
    return Executed(id=new_id(), created_at=now(), policy_version=0, rollout=rollout,
                    outcomes=[to_outcome(None) for _ in range(group)])


async def measure(verifier: Verifier, messages: list[Executed], concurrency: int) -> dict:
    for m in messages[:concurrency]:  # warm-up: imports, the math worker, caches
        await verifier.handle(m)
    latencies: list[float] = []
    limiter = trio.CapacityLimiter(concurrency)

    async def one(m: Executed) -> None:
        async with limiter:
            t = time.perf_counter()
            await verifier.handle(m)
            latencies.append(time.perf_counter() - t)

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for m in messages:
            nursery.start_soon(one, m)
    wall = time.perf_counter() - started
    return {"messages_per_s": len(messages) / wall,
            "p50_ms": statistics.median(latencies) * 1000, "wall_s": wall}


async def run(n: int, group: int, concurrency: int, processes: int) -> dict:
    messages = [executed(i, group) for i in range(n)]
    out: dict = {"messages": n, "group": group, "concurrency": concurrency,
                 "scorer_processes": processes}
    out["thread"] = await measure(Verifier(), messages, concurrency)
    async with open_worker_pool(processes, None, SCORER_PRELOAD) as pool:
        out["pool"] = await measure(Verifier(scorers=pool), messages, concurrency)
    out["pool_over_thread"] = out["pool"]["messages_per_s"] / out["thread"]["messages_per_s"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--messages", type=int, default=400)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--processes", type=int, default=2)
    args = parser.parse_args()
    # the per-message "verified" log lines would be most of the work measured: warnings only
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    result = trio.run(run, args.messages, args.group, args.concurrency, args.processes)
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
