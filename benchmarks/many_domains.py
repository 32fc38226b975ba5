"""Claim: the real scheduler admits tasks across 500 declared domains at under 1 ms of
overhead per task (p50), admission round trips to a real Redis included.

500 domains are declared as data, the way a user declares them: one generated JSONL file
each (40 rows) in a temporary directory, a ``[domain.<name>]`` table each (``kind =
"exact"``, a weight 1 to 8) in a TOML file, loaded by ``config.schema.load_config`` and
registered by ``domains.declared.declare_domains``. A real Redis is started
(``queues.server.ServerProcess``, the system's redis-server as the tests use it) and the real
:class:`actors.scheduler.Scheduler` runs its admission round as its serve loop does: the
per-domain counters read for the adaptive share (``observe_domains``), the bounds read
(``admissible``: the admitted counter, the stop flag, the staleness D, the generator
group's backlog), then the tasks sampled (fair share, epoch order), encoded and published
with the admitted counter and the per-domain tally in one compare-and-set script
(``admit``). One round is timed from the first read to the script's reply; a task's
overhead is its round's time divided by the tasks the round admitted. Between rounds
(untimed) a stand-in generator reads and acknowledges every task, and a stand-in verifier
adds each group's ``resolved`` / ``trained`` counts (0-60% of a domain's groups not
trained), so the adaptive share has feedback; the learner's version advances one per
``learner.groups_per_step`` admitted. Settings as shipped: ``scheduler.max_backlog`` 16
(so a round admits up to 16 tasks), ``scheduler.adaptive`` with dynamic sampling.

Baseline in the same run: the same scheduler, Redis and settings with 7 declared domains.

    .venv/bin/python benchmarks/many_domains.py --json [--domains 500] [--tasks 10000]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from streamrl.actors.scheduler import Scheduler
from streamrl.config.schema import load_config
from streamrl.domains.declared import declare_domains
from streamrl.protocol import names as N
from streamrl.protocol.messages import Task
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import decode
from streamrl.queues.operations import increment
from streamrl.queues.server import ServerProcess, find_server_binary
from streamrl.queues.streams import ConsumerSettings, open_stream_consumer
from streamrl.runtime.context import ActorContext

ROWS = 40


def declare(root: Path, run: str, redis_url: str, domains: int, seed: int) -> Path:
    """Write ``domains`` JSONL files and the TOML that declares them; returns the TOML."""
    rng = random.Random(seed)
    names = [f"d{i:03d}" for i in range(domains)]
    tables = []
    for name in names:
        data = root / f"{name}.jsonl"
        with data.open("w") as f:
            for i in range(ROWS):
                a, b = rng.randint(1, 99), rng.randint(1, 99)
                f.write(json.dumps({"id": f"{name}-{i}", "prompt": f"{name}: {a} + {b}?",
                                    "answer": str(a + b)}) + "\n")
        tables.append(f'[domain.{name}]\nkind = "exact"\ndata = "{data}"\n'
                      f"weight = {rng.randint(1, 8)}\n")
    config = root / f"{run}.toml"
    config.write_text(
        f'[run]\nname = "{run}"\nredis_url = "{redis_url}"\nwork_dir = "{root}"\n\n'
        f"[scheduler]\ndomains = {json.dumps(names)}\nadaptive = true\n\n"
        "[verifier]\ndynamic_sampling = true\n\n"
        "[learner]\ngroups_per_step = 16\n\n" + "\n".join(tables)
    )
    return config


async def measure(config_path: Path, tasks: int, seed: int) -> dict[str, Any]:
    config = load_config(config_path)
    t0 = time.perf_counter()
    declare_domains(config.domain)  # the real declaration path: a factory per table
    names = N.Names(config.run.name)
    client = RedisClient(config.run.redis_url)
    skip = {d: random.Random(seed + i).uniform(0.0, 0.6)
            for i, d in enumerate(config.scheduler.domains)}
    outcome = random.Random(seed + 1)
    rounds: list[tuple[float, int]] = []  # (seconds, tasks admitted)
    try:
        ctx = ActorContext(config, client, names)
        scheduler = Scheduler(ctx)  # builds every domain and loads its train items
        startup_s = time.perf_counter() - t0
        settings = ConsumerSettings(block_ms=1)
        async with open_stream_consumer(client, names, N.TASKS, stage="generator",
                                        settings=settings) as generator:
            admitted_total = 0
            while admitted_total < tasks:
                version = admitted_total // config.learner.groups_per_step
                start = time.perf_counter()
                await scheduler.observe_domains()
                count, admitted = await scheduler.admissible(version)
                added = await scheduler.admit(count, version, admitted) if count else 0
                rounds.append((time.perf_counter() - start, added))
                admitted_total += added
                # untimed: the generator takes the tasks, the verifier resolves their groups
                deliveries = await generator.read(1000)
                await generator.ack([d.entry_id for d in deliveries])
                for d in deliveries:
                    domain = decode(d.payload or b"", Task).domain
                    await increment(client, names.counter(f"resolved:{domain}"))
                    if outcome.random() >= skip[domain]:
                        await increment(client, names.counter(f"trained:{domain}"))
    finally:
        client.close()
    per_task = [s / n * 1e3 for s, n in rounds for _ in range(n)]
    per_round = [s * 1e3 for s, n in rounds if n]
    tq, rq = statistics.quantiles(per_task, n=10), statistics.quantiles(per_round, n=10)
    stats = scheduler.fair.statistics()
    return {
        "domains": len(config.scheduler.domains),
        "tasks": len(per_task),
        "rounds": len(per_round),
        "tasks_per_round_mean": statistics.fmean(n for _, n in rounds if n),
        "overhead_ms_per_task": {"p50": tq[4], "p90": tq[8], "mean": statistics.fmean(per_task)},
        "round_ms": {"p50": rq[4], "p90": rq[8]},
        "startup_s": round(startup_s, 2),
        "domains_admitted": sum(s.admitted > 0 for s in stats.values()),
    }


async def run(domains: int, baseline: int, tasks: int, seed: int) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="many-domains-"))
    binary = find_server_binary(shutil.which("redis-server") or "")
    try:
        with ServerProcess(data_dir=root / "redis", binary=binary) as server:
            out = {}
            for key, n in (("many", domains), ("baseline", baseline)):
                (root / key).mkdir()
                path = declare(root / key, f"bench-{key}", server.url, n, seed)
                out[key] = await measure(path, tasks, seed)
            return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--domains", type=int, default=500)
    ap.add_argument("--baseline-domains", type=int, default=7)
    ap.add_argument("--tasks", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    results: dict[str, Any] = trio.run(run, args.domains, args.baseline_domains, args.tasks,
                                       args.seed)
    results["claims"] = {
        "p50_under_1ms": results["many"]["overhead_ms_per_task"]["p50"] < 1.0,
        "every_domain_admitted": results["many"]["domains_admitted"] == args.domains,
    }
    if args.json:
        print(json.dumps(results, indent=2))
        return
    for key in ("many", "baseline"):
        r = results[key]
        o = r["overhead_ms_per_task"]
        print(f"{r['domains']} domains: {o['p50']:.3f} ms/task p50, {o['p90']:.3f} p90 "
              f"({r['tasks']} tasks, {r['rounds']} rounds, "
              f"round p50 {r['round_ms']['p50']:.2f} ms)")


if __name__ == "__main__":
    main()
