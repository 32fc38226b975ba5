"""Claim: the replicas of each stage that keep one learner busy, and the learners one Redis
shard can serve, follow from each stage's throughput measured alone (docs/scaling.md).

One command measures, on this machine, every stage of a deployment's config (default
``configs/demo.toml``) in isolation, with the project's own components and that config's
settings (no mocks, no Redis except for the queue), in this order, each stage's messages made
by the stage before it:

- **generator**: ``actors.generator.open_engine`` (the in-process transformers engine with
  ``generator.max_batch`` and ``generator.threads``; or the SGLang client if the config says
  so) and ``Generator.handle`` on ``--gen-groups`` training tasks of the config's first
  domain (``make_task``, the scheduler's sampling: ``group_size``, ``max_new_tokens``,
  ``temperature``; prompts rendered with the chat template), ``--gen-inflight`` tasks at once
  (default ``scheduler.max_backlog``: the most tasks the scheduler keeps queued for the
  generators). ``completions_per_s`` = completions / wall time; ``tokens_per_s`` = generated
  tokens / wall time. One short warm-up call is not timed.
- **executor**: ``actors.executor.sandboxes_for(config)`` (the process backend: resident
  bubblewrap sandboxes, ``executor.pool_size``) and ``Executor.handle``, ``executor.concurrency``
  rollouts at once, on ``--exec-groups`` rollouts per domain: the generator's own rollouts
  (cycled; the model's real programs, so some fail, loop to the time limit or hold no program
  and run nothing) for the demo's domain, and for ``code`` its items with a fixed submission
  (the entry point returning its first argument) run by the domain's harness
  (``exec_request``: every hidden test in its own child process). ``executions_per_s`` =
  sandbox runs made / wall time; ``groups_per_s`` = rollouts / wall time.
- **verifier**: ``Verifier(scorers=pool)`` with ``verifier.scorer_processes`` scorer processes
  (``runtime.workers``, the path ``verifier.serve`` takes), ``verifier.concurrency`` messages at
  once, on ``--verify-groups`` executed groups per domain: the executor's outputs for the demo's
  domain and ``code``, and ``math`` groups from ``benchmarks/verifier_throughput.py`` (sympy
  equivalence, no sandbox). ``groups_per_s`` and ``samples_per_s`` = groups (samples) / wall.
- **learner**: ``Trainer.from_dir`` with ``actors.learner.train_config(config)`` (the demo: fp32
  on CPU, ``learner.threads`` = 1) and ``Trainer.step`` on ``learner.groups_per_step`` of the
  verified groups (real prompts, completions and behaviour logprobs; rewards replaced by 0/1
  alternating so that no group is dropped for zero variance): one warm-up step, then
  ``--learner-steps`` timed. ``step_s`` = median ``StepStats.seconds``; ``tokens_per_s`` =
  trained (completion) tokens / ``step_s``; ``sequence_tokens_per_s`` counts prompts too.
  Publishing the weights (a background thread in the learner actor) is not timed.
- **queue**: ``benchmarks/queue_hop.py --json --no-ray --consumers --shards`` (one consumer
  process, no cluster) in a child process, its payloads the mean size of the demo's work
  messages (``message_bytes``: task, rollout, executed, trajectory as encoded on the wire),
  on a redis-server it starts (``--redis-url``: on yours), or ``--hop-json FILE`` to cite an
  earlier run.
  ``hop_task_per_s``: one consumer, one trio task per message (what ``runtime.serve`` does);
  ``server_cpu_us_per_hop``: redis-server CPU per such hop; ``shard_ceiling_hops_per_s`` =
  1e6 / that (a Redis shard executes commands on one thread: its ceiling when that core is
  saturated, whatever the number of clients).

``model`` derives, per learner step (``groups_per_step`` x ``group_size`` samples): the
seconds each stage needs with one replica (``stage_s_per_step`` = work / throughput; the
generator's work includes the held-out rounds' share, ``eval_items`` x domains samples every
``eval_every`` steps); ``replicas`` = ceil(stage_s_per_step / learner ``step_s``), at least 1;
``hops_per_step`` = 4 per training group (tasks, rollouts, executed, trajectories: each entry
written once and handed off once) + 2 events (weights, metrics) + 4 per held-out task times
its share; ``hops_per_s_per_learner`` = hops_per_step / ``step_s``; ``learners_per_shard`` =
floor(shard_ceiling_hops_per_s / hops_per_s_per_learner).

Before measuring, the script waits while ``benchmarks/queue_hop.py`` or
``benchmarks/shards.py`` runs (up to ``--wait-max-s``) and records load averages around every
stage: the development machine has 2 cores shared with other people's work, so its figures
are orders of magnitude. Left out: stale drops, the learner's publishing, the actors' per-time
Redis calls (heartbeats, reclaim, trims, backlog checks) and contention between stages
sharing cores.

    .venv/bin/python benchmarks/capacity.py --json                      # the demo, 4-6 min
    .venv/bin/python benchmarks/capacity.py --json --model tiny --gen-groups 4 --learner-steps 1
    .venv/bin/python benchmarks/capacity.py --json --set learner.device=cuda   # not run here
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from itertools import cycle, islice
from pathlib import Path
from typing import Any

import msgspec
import structlog
import trio

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from streamrl.actors.executor import Executor, sandboxes_for  # noqa: E402
from streamrl.actors.generator import Generator, open_engine  # noqa: E402
from streamrl.actors.learner import train_config  # noqa: E402
from streamrl.actors.scheduler import domain_sampling, make_task  # noqa: E402
from streamrl.actors.verifier import SCORER_PRELOAD, Verifier  # noqa: E402
from streamrl.config.schema import Config, load_config  # noqa: E402
from streamrl.domains.registry import get_domain  # noqa: E402
from streamrl.models import load_tokenizer, resolve_model  # noqa: E402
from streamrl.protocol.messages import (  # noqa: E402
    Executed,
    Rollout,
    Sample,
    Sampling,
    Task,
    Trajectory,
    new_id,
    now,
)
from streamrl.queues.codec import encode  # noqa: E402
from streamrl.runtime.serve import Output  # noqa: E402
from streamrl.runtime.workers import open_worker_pool  # noqa: E402

BUSY_PATTERN = "benchmarks/queue_hop.py|benchmarks/shards.py"
HOPS_PER_GROUP = 4  # tasks, rollouts, executed, trajectories (or evals)
EVENTS_PER_STEP = 2  # weights, metrics
DEFINITIONS = {
    "generator.completions_per_s": "completions / wall time, Generator.handle on the demo's "
    "training tasks, gen_inflight tasks at once, the config's engine",
    "generator.tokens_per_s": "generated (completion) tokens / wall time, same run",
    "executor.executions_per_s": "sandbox runs made / wall time, Executor.handle, "
    "executor.concurrency rollouts at once (a sample without a program runs nothing)",
    "verifier.groups_per_s": "executed groups scored / wall time, Verifier with the scorer "
    "process pool, verifier.concurrency at once",
    "learner.tokens_per_s": "trained completion tokens / median Trainer.step seconds, "
    "groups_per_step real groups",
    "queue.hop_task_per_s": "queue_hop.py: one consumer, one trio task per message, "
    "payloads of the demo's mean message size",
    "queue.shard_ceiling_hops_per_s": "1e6 / redis-server CPU us per hop_task hop",
    "model.replicas": "ceil(stage seconds per learner step with one replica / learner step_s)",
    "model.learners_per_shard": "floor(shard ceiling / hops per second of one learner's run)",
}


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def load1() -> float:
    """The 1-minute load average (recorded at the start and end of every stage)."""
    return round(os.getloadavg()[0], 2)


def wait_while_busy(max_wait_s: float) -> float:
    """Seconds waited while another queue benchmark ran (``pgrep -f``), at most max_wait_s."""
    started = time.monotonic()
    while time.monotonic() - started < max_wait_s:
        found = subprocess.run(["pgrep", "-f", BUSY_PATTERN], capture_output=True, text=True)
        if not found.stdout.strip():
            break
        print(f"capacity: waiting, another benchmark runs: {found.stdout.split()}",
              file=sys.stderr)
        time.sleep(20)
    return round(time.monotonic() - started, 1)


async def timed(handle: Callable[[Any], Awaitable[Any]], messages: Sequence[Any],
                concurrency: int) -> tuple[float, list[float], list[Any]]:
    """(wall s, per-message s, results in order): ``handle`` on each, ``concurrency`` at once."""
    results: list[Any] = [None] * len(messages)
    seconds: list[float] = []
    limiter = trio.CapacityLimiter(concurrency)

    async def one(i: int) -> None:
        async with limiter:
            started = time.perf_counter()
            results[i] = await handle(messages[i])
            seconds.append(time.perf_counter() - started)

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(len(messages)):
            nursery.start_soon(one, i)
    return time.perf_counter() - started, seconds, results


def only(results: list[Any], kind: type[msgspec.Struct]) -> Any:
    """The one output message of type ``kind`` among a handler's results."""
    [message] = [r.message for r in results if isinstance(r, Output)
                 and isinstance(r.message, kind)]  # fmt: skip
    return message


def rate(n: float, seconds: float) -> float:
    return round(n / seconds, 3) if seconds > 0 else 0.0


# --------------------------------------------------------------------------- generator


def train_tasks(config: Config, n: int) -> list[Task]:
    """The scheduler's training tasks for the first ``n`` items of the config's first domain."""
    name = config.scheduler.domains[0]
    sampling = domain_sampling(config, name, config.scheduler.temperature)
    items = get_domain(name).load_items("train")[:n]
    return [make_task(name, item, split="train", group_size=config.scheduler.group_size,
                      sampling=sampling, version=0) for item in items]  # fmt: skip


async def measure_generator(config: Config, groups: int,
                            inflight: int) -> tuple[dict[str, Any], list[Rollout]]:
    model_dir = resolve_model(config.model.spec)
    tokenizer = load_tokenizer(model_dir)
    tasks = train_tasks(config, groups + 1)
    warm = msgspec.structs.replace(tasks[0], group_size=1, sampling=Sampling(max_new_tokens=4))
    load_start = load1()
    async with open_engine(config.generator, model_dir) as engine:
        generator = Generator(engine, tokenizer)
        await generator.handle(warm)
        wall, seconds, results = await timed(generator.handle, tasks[1:], inflight)
        stats = getattr(engine, "statistics", None)
    rollouts = [only(r, Rollout) for r in results]
    completions = [s for r in rollouts for s in r.samples]
    tokens = sum(len(s.tokens) // 4 for s in completions)
    prompt_tokens = [len(r.prompt_ids) // 4 for r in rollouts]
    report = {
        "engine": config.generator.engine, "model": config.model.spec,
        "threads": config.generator.threads, "max_batch": config.generator.max_batch,
        "groups": len(rollouts), "inflight": inflight, "group_size": config.scheduler.group_size,
        "max_new_tokens": tasks[0].sampling.max_new_tokens,
        "temperature": tasks[0].sampling.temperature,
        "completions_per_s": rate(len(completions), wall),
        "tokens_per_s": rate(tokens, wall),
        "groups_per_s": rate(len(rollouts), wall),
        "mean_completion_tokens": round(tokens / len(completions), 1),
        "mean_prompt_tokens": round(statistics.mean(prompt_tokens), 1),
        "group_p50_s": round(statistics.median(seconds), 2), "wall_s": round(wall, 1),
        "loadavg_1m": [load_start, load1()],
    }
    if stats is not None:  # the in-process engine's (the SGLang client has none of these)
        report["engine_max_batch_rows"] = getattr(stats(), "max_batch_rows", None)
    return report, rollouts


# --------------------------------------------------------------------------- executor


def code_rollouts(n: int, group_size: int) -> list[Rollout]:
    """``code`` items answered by a fixed submission: the harness runs every hidden test."""
    rollouts = []
    for item in get_domain("code").load_items("train")[:n]:
        text = f"```python\ndef {item.entry}(*args):\n    return args[0] if args else None\n```"
        task = make_task("code", item, split="train", group_size=group_size,
                         sampling=Sampling(), version=0)
        samples = [Sample(tokens=b"", logprobs=b"", text=text, finish_reason="stop",
                          weight_version=0) for _ in range(group_size)]
        rollouts.append(Rollout(id=new_id(), created_at=now(), policy_version=0, task=task,
                                prompt_ids=b"", samples=samples))
    return rollouts


async def measure_executor(config: Config, work: dict[str, list[Rollout]],
                           groups: int) -> tuple[dict[str, Any], dict[str, list[Executed]]]:
    concurrency = config.executor.concurrency
    report: dict[str, Any] = {"backend": config.executor.backend, "concurrency": concurrency,
                              "pool_size": config.executor.pool_size, "domains": {}}
    executed: dict[str, list[Executed]] = {}
    sandboxes = sandboxes_for(config)
    async with sandboxes.opened():
        report["isolation"] = sandboxes.open_for([get_domain(d) for d in work])
        executor = Executor(sandboxes, domain_config=config.domain)
        for domain, rollouts in work.items():
            messages = list(islice(cycle(rollouts), groups))
            load_start = load1()
            await executor.handle(messages[0])  # warm-up: the pool's sandboxes started
            wall, seconds, results = await timed(executor.handle, messages, concurrency)
            executed[domain] = [only(r, Executed) for r in results]
            outcomes = [o for e in executed[domain] for o in e.outcomes]
            runs = sum(1 for o in outcomes if o.exit_code is not None or o.timed_out)
            report["domains"][domain] = {
                "groups": len(messages), "samples": len(outcomes), "executions": runs,
                "executions_per_s": rate(runs, wall), "groups_per_s": rate(len(messages), wall),
                "samples_per_s": rate(len(outcomes), wall),
                "exit_0": sum(1 for o in outcomes if o.exit_code == 0),
                "timed_out": sum(1 for o in outcomes if o.timed_out),
                "group_p50_s": round(statistics.median(seconds), 3), "wall_s": round(wall, 1),
                "loadavg_1m": [load_start, load1()],
            }
    return report, executed


# --------------------------------------------------------------------------- verifier


def math_executed(n: int, group_size: int) -> list[Executed]:
    from verifier_throughput import executed  # benchmarks/verifier_throughput.py

    return [executed(i, group_size) for i in range(n)]


async def measure_verifier(config: Config, work: dict[str, list[Executed]],
                           groups: int) -> tuple[dict[str, Any], dict[str, list[Trajectory]]]:
    cfg = config.verifier
    report: dict[str, Any] = {"scorer_processes": cfg.scorer_processes,
                              "concurrency": cfg.concurrency, "domains": {}}
    verified: dict[str, list[Trajectory]] = {}
    async with open_worker_pool(cfg.scorer_processes, None, SCORER_PRELOAD) as pool:
        verifier = Verifier(cfg.dynamic_sampling, scorers=pool,
                            score_timeout_s=cfg.score_timeout_s)
        for domain, executed in work.items():
            messages = list(islice(cycle(executed), groups))
            load_start = load1()
            for m in messages[: cfg.concurrency]:  # warm-up: imports in every worker, caches
                await verifier.handle(m)
            wall, seconds, results = await timed(verifier.handle, messages, cfg.concurrency)
            trajectories = verified[domain] = [only(r, Trajectory) for r in results]
            samples = sum(len(t.rewards) for t in trajectories)
            report["domains"][domain] = {
                "groups": len(messages), "samples": samples,
                "groups_per_s": rate(len(messages), wall), "samples_per_s": rate(samples, wall),
                "mean_reward": round(statistics.mean(r for t in trajectories for r in t.rewards),
                                     3),
                "group_p50_ms": round(statistics.median(seconds) * 1000, 1),
                "wall_s": round(wall, 2), "loadavg_1m": [load_start, load1()],
            }
    return report, verified


# --------------------------------------------------------------------------- learner


def measure_learner(config: Config, trajectories: list[Trajectory],
                    steps: int) -> dict[str, Any]:
    from streamrl.learner.train import Trainer

    n = config.learner.groups_per_step
    groups = [msgspec.structs.replace(t, rewards=[float(i % 2) for i in range(len(t.rewards))])
              for t in islice(cycle(trajectories), n)]  # fmt: skip
    settings = train_config(config)
    base = resolve_model(config.model.spec)
    load_start = load1()
    trainer = Trainer.from_dir(base, settings, ref_dir=base)
    trainer.step(groups)  # warm-up
    seconds, stats = [], None
    for _ in range(steps):
        stats = trainer.step(groups)
        seconds.append(stats.seconds)
    assert stats is not None and not stats.skipped and stats.groups == n
    step_s = statistics.median(seconds)
    sequence = sum(len(t.rollout.prompt_ids) // 4 * len(t.rollout.samples)
                   + sum(len(s.tokens) // 4 for s in t.rollout.samples) for t in groups)
    return {
        "model": config.model.spec, "device": settings.device, "threads": settings.num_threads,
        "micro_batch_size": settings.micro_batch_size,
        "grad_checkpointing": settings.grad_checkpointing,
        "groups_per_step": n, "samples_per_step": stats.samples,
        "tokens_per_step": stats.tokens, "sequence_tokens_per_step": sequence,
        "step_s": round(step_s, 2), "step_s_min": round(min(seconds), 2),
        "step_s_runs": [round(s, 2) for s in seconds],
        "tokens_per_s": rate(stats.tokens, step_s),
        "sequence_tokens_per_s": rate(sequence, step_s),
        "samples_per_s": rate(stats.samples, step_s),
        "loadavg_1m": [load_start, load1()],
    }


# --------------------------------------------------------------------------- queue


def message_bytes(trajectories: list[Trajectory]) -> dict[str, int]:
    """Mean encoded size of each work message of the demo's groups (as on the wire)."""
    sizes: dict[str, list[int]] = {"task": [], "rollout": [], "executed": [], "trajectory": []}
    for t in trajectories:
        executed = Executed(id=new_id(), created_at=now(), policy_version=0,
                            rollout=t.rollout, outcomes=t.outcomes)
        for name, message in (("task", t.rollout.task), ("rollout", t.rollout),
                              ("executed", executed), ("trajectory", t)):
            sizes[name].append(len(encode(message)))
    return {name: round(statistics.mean(values)) for name, values in sizes.items()}


def measure_queue(size: int, args: argparse.Namespace) -> dict[str, Any]:
    cited, messages = args.hop_json, args.hop_messages
    if cited:
        hop = json.loads(Path(cited).read_text())
        source = f"cited: {cited}"
    else:
        argv = [sys.executable, str(HERE / "queue_hop.py"), "--json", "--no-ray",
                "--messages", str(messages), "--unbatched-messages", "500", "--repeats", "1",
                "--size", str(size), "--latency-seconds", "2", "--xadd-requests", "20000",
                "--consumers", "--shards"]  # one process, one server: no cluster runs
        argv += ["--redis-url", args.redis_url] if args.redis_url else []
        done = subprocess.run(argv, capture_output=True, text=True, check=True)
        hop = json.loads(done.stdout)
        source = " ".join(["benchmarks/queue_hop.py", *argv[2:]]).split(" --redis-url")[0]
    server_us = hop["cpu_us_per_hop"]["hop_task"]["server"]
    return {
        "source": source, "payload_bytes": hop["payload_bytes"],
        "redis": hop.get("redis"), "messages": hop["messages"],
        "hop_per_s": hop["hop_per_s"], "hop_task_per_s": hop["hop_task_per_s"],
        "hop_p50_ms": hop["hop_p50_ms"],
        "client_cpu_us_per_hop": hop["cpu_us_per_hop"]["hop_task"]["client"],
        "server_cpu_us_per_hop": server_us,
        "shard_ceiling_hops_per_s": round(1e6 / server_us) if server_us else None,
        "redis_xadd_per_s": hop.get("redis_xadd_per_s"),
        "loadavg_1m": [hop["loadavg_start"][0], hop["loadavg_end"][0]],
    }


# --------------------------------------------------------------------------- the model


def model(config: Config, gen: dict[str, Any], exe: dict[str, Any], ver: dict[str, Any],
          learner: dict[str, Any], queue: dict[str, Any]) -> dict[str, Any]:
    """Per learner step: each stage's seconds with one replica, the replicas that keep the
    learner busy, the Redis hops and the learners one shard serves (module docstring)."""
    domain = config.scheduler.domains[0]
    n, g = config.learner.groups_per_step, config.scheduler.group_size
    sc = config.scheduler
    eval_domains = len(sc.domains) + len(sc.eval_domains)
    eval_tasks = sc.eval_items * eval_domains / sc.eval_every if sc.eval_every else 0.0
    step_s = learner["step_s"]
    executions_per_sample = exe["domains"][domain]["executions"] / exe["domains"][domain]["samples"]
    work = {  # per learner step: (units, stage throughput in those units per second)
        "generator": (n * g + eval_tasks, gen["completions_per_s"]),
        "executor": ((n * g + eval_tasks) * executions_per_sample,
                     exe["domains"][domain]["executions_per_s"]),
        "verifier": (n + eval_tasks, ver["domains"][domain]["groups_per_s"]),
    }
    stages = {}
    for stage, (units, per_s) in work.items():
        seconds = units / per_s
        stages[stage] = {"work_per_step": round(units, 2), "throughput_per_s": per_s,
                         "s_per_step": round(seconds, 2),
                         "replicas": max(1, math.ceil(seconds / step_s))}
    hops = HOPS_PER_GROUP * (n + eval_tasks) + EVENTS_PER_STEP
    hops_per_s = hops / step_s
    ceiling = queue.get("shard_ceiling_hops_per_s")
    return {
        "domain": domain, "groups_per_step": n, "group_size": g, "samples_per_step": n * g,
        "eval_tasks_per_step": round(eval_tasks, 2),
        "generated_tokens_per_step": round(n * g * gen["mean_completion_tokens"]),
        "learner_step_s": step_s, "stages": stages,
        "bottleneck": max(stages, key=lambda s: stages[s]["s_per_step"]),
        "hops_per_step": round(hops, 1), "hops_per_step_training_only":
            HOPS_PER_GROUP * n + EVENTS_PER_STEP,
        "hops_per_sample": round(HOPS_PER_GROUP / g, 3),
        "hops_per_s_per_learner": round(hops_per_s, 2),
        "learners_per_shard": math.floor(ceiling / hops_per_s) if ceiling else None,
    }


# --------------------------------------------------------------------------- main


async def measure_pipeline(config: Config, args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {}
    report["generator"], rollouts = await measure_generator(
        config, args.gen_groups, args.gen_inflight or config.scheduler.max_backlog)
    domain = config.scheduler.domains[0]
    exec_work = {domain: rollouts, "code": code_rollouts(16, config.scheduler.group_size)}
    report["executor"], executed = await measure_executor(config, exec_work, args.exec_groups)
    verify_work = {**executed, "math": math_executed(64, config.scheduler.group_size)}
    report["verifier"], verified = await measure_verifier(config, verify_work,
                                                          args.verify_groups)
    report["_trajectories"] = verified[domain]
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--config", default="configs/demo.toml")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--model", help="model.spec instead of the config's (e.g. tiny)")
    parser.add_argument("--gen-groups", type=int, default=6, help="tasks timed")
    parser.add_argument("--gen-inflight", type=int, default=0,
                        help="tasks at once (0: scheduler.max_backlog)")
    parser.add_argument("--exec-groups", type=int, default=24, help="rollouts per domain")
    parser.add_argument("--verify-groups", type=int, default=400, help="groups per domain")
    parser.add_argument("--learner-steps", type=int, default=2, help="timed steps")
    parser.add_argument("--hop-messages", type=int, default=10_000)
    parser.add_argument("--hop-json", help="cite this queue_hop.py JSON instead of running it")
    parser.add_argument("--redis-url", help="queue_hop.py on this server (your Redis) instead "
                        "of one it starts; its keys are deleted after (see queue_hop.py)")
    parser.add_argument("--wait-max-s", type=float, default=900.0)
    args = parser.parse_args()
    overrides = args.set + ([f"model.spec={args.model}"] if args.model else [])
    config = load_config(args.config, overrides)
    # the per-message log lines of the actors would be measured too: warnings only
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

    report: dict[str, Any] = {
        "benchmark": "capacity", "definitions": DEFINITIONS, "config": args.config,
        "overrides": overrides, "cpus": os.cpu_count(), "machine": platform.machine(),
        "python": platform.python_version(), "loadavg_before_wait": loadavg(),
    }
    report["waited_s"] = wait_while_busy(args.wait_max_s)
    report["started_utc"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    report["loadavg_start"] = loadavg()
    report.update(trio.run(measure_pipeline, config, args))
    trajectories = report.pop("_trajectories")
    report["learner"] = measure_learner(config, trajectories, args.learner_steps)
    report["message_bytes"] = message_bytes(trajectories)
    size = max(64, round(statistics.mean(report["message_bytes"].values())))
    report["queue"] = measure_queue(size, args)
    report["model"] = model(config, report["generator"], report["executor"],
                            report["verifier"], report["learner"], report["queue"])
    report["loadavg_end"] = loadavg()
    report["finished_utc"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    if args.json:
        print(json.dumps(report, indent=2))
        return
    for key, value in report.items():
        if key != "definitions":
            print(f"{key:>20}: {json.dumps(value)}")


if __name__ == "__main__":
    main()
