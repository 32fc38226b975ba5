"""Claim: the scheduler shares capacity across 200 domains at under 1 ms per task, and the
trained samples reach each domain's target ratio within 10% (relative) after 20,000 tasks.

200 domains are generated and registered (``domains.registry.register``), each with its own
small item set, a weight (1 to 8) and a rate of groups that carry no signal (zero reward
variance, skipped by dynamic sampling: 0% to 60%). The real scheduler path is timed per
task: :class:`actors.scheduling.FairShare` picks the domain, an item is drawn, the ``Task``
is built and encoded (``actors.scheduler.make_task``, MessagePack), as the scheduler does
before its admission script. Feedback (resolved/trained groups) arrives after a pipeline
lag, as from the verifier's counters. Baseline in the same run: the same fair queueing
without adaptive re-weighting. Simplifications: no Redis round trip (the admission script
is one call per batch, measured in benchmarks/queue_hop.py); skips are i.i.d. per domain.

    .venv/bin/python benchmarks/many_domains.py --json [--domains 200] [--tasks 20000]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import time
from collections import deque
from typing import Any

import msgspec

from streamrl.actors.scheduler import make_task
from streamrl.actors.scheduling import FairShare, Share
from streamrl.domains.base import NO_SANDBOX, SINGLE_TURN
from streamrl.domains.registry import get_domain, register
from streamrl.protocol.messages import Sampling
from streamrl.queues.codec import encode


class GenItem(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    prompt: str
    answer: str


def make_domain_class(name: str, n_items: int) -> type:
    class Generated:
        item_type = GenItem
        default_max_new_tokens = 32
        episode = SINGLE_TURN
        sandbox = NO_SANDBOX

        def __init__(self) -> None:
            self.name = name
            self.items = [GenItem(id=f"{name}-{i}", prompt=f"{name}: what is {i} + {i}?",
                                  answer=str(2 * i)) for i in range(n_items)]

        def load_items(self, split: str) -> list[GenItem]:
            return self.items

        def render_prompt(self, item: Any, tokenizer: Any) -> list[int]:
            return []

        def exec_request(self, item: Any, completion_text: str) -> None:
            return None

        def score(self, item: GenItem, completion_text: str, result: Any) -> float:
            return float(completion_text.strip() == item.answer)

    return Generated


def run(domains: int, tasks: int, adaptive: bool, lag: int, seed: int
        ) -> dict[str, Any]:
    rng = random.Random(seed)
    names = [f"gen{i:03d}" for i in range(domains)]
    for name in names:
        with contextlib.suppress(ValueError):  # registered by the previous run (same process)
            register(name)(make_domain_class(name, 16))
    items = {n: get_domain(n).load_items("train") for n in names}
    weights = {n: float(rng.randint(1, 8)) for n in names}
    skip = {n: rng.uniform(0.0, 0.6) for n in names}
    fair = FairShare([Share(n, weights[n]) for n in names], adaptive=adaptive)
    sampling = Sampling(max_new_tokens=32, temperature=0.7)
    inflight: deque[str] = deque()
    per_task: list[float] = []
    pick_ns = 0
    outcome = random.Random(seed + 1)
    for _ in range(tasks):
        t0 = time.perf_counter_ns()
        name = fair.pick()
        t1 = time.perf_counter_ns()
        assert name is not None
        encode(make_task(name, rng.choice(items[name]), split="train", group_size=8,
                         sampling=sampling, version=0))
        per_task.append((time.perf_counter_ns() - t0) / 1e6)
        pick_ns += t1 - t0
        inflight.append(name)
        if len(inflight) > lag:
            done = inflight.popleft()
            fair.resolved(done, trained=outcome.random() >= skip[done])
    while inflight:  # every admitted task finishes: the ratios of all 20,000
        done = inflight.popleft()
        fair.resolved(done, trained=outcome.random() >= skip[done])
    stats = fair.statistics()
    rel = {n: abs(s.trained_ratio / s.target_ratio - 1) for n, s in stats.items()}
    trained = sum(s.trained for s in stats.values())
    cuts = statistics.quantiles(per_task, n=100)
    return {
        "adaptive": adaptive,
        "tasks": tasks,
        "trained_groups": trained,
        "overhead_ms_per_task": {"mean": statistics.fmean(per_task), "p50": cuts[49],
                                 "p99": cuts[98]},
        "pick_us_mean": pick_ns / tasks / 1e3,
        "ratio_rel_error": {"max": max(rel.values()), "mean": statistics.fmean(rel.values()),
                            "within_10pct": sum(r <= 0.10 for r in rel.values())},
        "worst_domains": sorted(
            ({"domain": n, "weight": weights[n], "skip": round(skip[n], 3),
              "target": round(stats[n].target_ratio, 5),
              "achieved": round(stats[n].trained_ratio, 5)} for n in names),
            key=lambda d: -abs(d["achieved"] / d["target"] - 1))[:3],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--domains", type=int, default=200)
    ap.add_argument("--tasks", type=int, default=20_000)
    ap.add_argument("--lag", type=int, default=64, help="groups in flight before feedback")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    results = {
        "domains": args.domains,
        "adaptive": run(args.domains, args.tasks, True, args.lag, args.seed),
        "baseline_static_wfq": run(args.domains, args.tasks, False, args.lag, args.seed),
    }
    a = results["adaptive"]
    results["claims"] = {
        "overhead_under_1ms": a["overhead_ms_per_task"]["p99"] < 1.0,
        "every_domain_within_10pct": a["ratio_rel_error"]["within_10pct"] == args.domains,
    }
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for key in ("adaptive", "baseline_static_wfq"):
            r = results[key]
            print(f"{key}: {r['overhead_ms_per_task']['mean']:.3f} ms/task, max rel error "
                  f"{r['ratio_rel_error']['max']:.3f}, within 10%: "
                  f"{r['ratio_rel_error']['within_10pct']}/{args.domains}")


if __name__ == "__main__":
    main()
