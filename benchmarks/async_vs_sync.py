"""Claim: streaming (asynchronous, bounded-staleness) RL keeps the learner busy and beats the
synchronous, on-policy loop when completion lengths are long-tailed.

Workload (the same for both modes): the real scheduler, the real generator actor (runtime,
retries, hand-offs) and the real learner actor (GRPO steps on the tiny Llama, checkpoints,
weights events), in one trio process against a real Redis started here. Two parts are
simulated, and only these:

- the generator's *engine*: each completion's length is drawn from a log-normal
  distribution (median ``--median-tokens``, sigma ``--sigma``, capped at ``--max-tokens``),
  its tokens are uniform random ids of the tokenizer's vocabulary (well-formed, real
  tokens for the learner), each with logprob ``-log(vocab)`` (the tiny random model is
  close to uniform, so ratios start near 1), and the request returns after
  ``--seconds-per-token * longest completion`` (a batched engine returns a group when its
  longest completion ends). A weights event sets the engine's version (no file load);
- the executor + verifier: replaced by one stage that gives each sample a random 0/1
  reward (seeded by the rollout), so groups carry signal; the arith domain's sandbox would
  score random tokens 0 everywhere and the learner would skip every step.

Modes: ``async`` (``learner.max_staleness = --staleness``, default 4; the scheduler keeps
up to ``(V + s + 1) * groups_per_step`` groups admitted) and ``sync`` (``max_staleness = 0``: the
next batch is admitted only after the learner published the version trained on the
previous one). Each mode trains ``--steps`` steps in a fresh run namespace.

Figures (with ``--repeats R``: R interleaved sync/async pairs, each mode's median run, and
the per-pair figures):
- ``speedup_async_over_sync``: wall time of the steps in sync mode / in async mode, from the
  first step's end to the last one's (model loading and pipeline fill excluded, in both);
- ``speedup_tokens_per_s``: the same ratio in trained completion tokens per second. Async
  mode trains the groups that finish first, so its batches are shorter on average (the
  long tail arrives later or is dropped as stale): this ratio is the smaller, fairer one;
- ``learner_busy_fraction`` (per mode): over the same window, the share of the learner's
  time spent inside ``Trainer.step``; the rest is waiting for groups and writing the
  checkpoint + publishing (so 1.0 is out of reach by the checkpoint's share).
  ``learner_not_waiting_fraction`` counts the checkpoint as busy too.

The staleness bound sets how deep the pipeline is: with ``s = 2`` only three batches are
admitted ahead, a long-tailed group (up to ``--max-tokens``) still running holds its slot
until it arrives and is dropped as stale, and the learner waits for its replacement now and
then (busy about 0.86 here); with ``s = 4`` the learner almost never waits.

    .venv/bin/python benchmarks/async_vs_sync.py --json
    .venv/bin/python benchmarks/async_vs_sync.py --json --steps 6    # quicker

In sync mode the generator holds each task until its engine serves the version the task was
admitted at (the shipped ``VersionGate``): without that, a task taken before the generator
has followed the weights event is sampled by the previous version, the learner drops it as
stale (staleness 1 > 0), and with the admission bound exhausted the run stalls.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from streamrl.actors import learner as learner_actor
from streamrl.actors import scheduler as scheduler_actor
from streamrl.actors.generator import Generator, VersionGate, serve_weight_updates
from streamrl.config.schema import load_config
from streamrl.inference.engine import Completion
from streamrl.models import load_tokenizer, resolve_model
from streamrl.protocol import names as N
from streamrl.protocol.messages import Rollout, Sampling, StepMetrics, Trajectory, new_id, now
from streamrl.protocol.names import Names
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import decode
from streamrl.queues.server import ServerProcess
from streamrl.runtime.context import ActorContext
from streamrl.runtime.logs import configure_logging
from streamrl.runtime.serve import Output


class LongTailEngine:
    """The Engine protocol with simulated, long-tailed completion latencies (see module)."""

    def __init__(self, vocab: int, args: argparse.Namespace) -> None:
        self.vocab = vocab
        self.args = args
        self.rng = np.random.default_rng(args.seed)
        self._version = 0
        self.busy_s = 0.0

    @property
    def weight_version(self) -> int:
        return self._version

    async def update_weights(self, path: str | Path, version: int) -> None:
        self._version = max(self._version, version)

    async def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Completion]:
        a = self.args
        version = self._version
        lengths = np.minimum(
            np.ceil(self.rng.lognormal(math.log(a.median_tokens), a.sigma, len(prompts))),
            a.max_tokens,
        ).astype(int)
        seconds = a.seconds_per_token * int(lengths.max())
        await trio.sleep(seconds)
        self.busy_s += seconds
        lp = -math.log(self.vocab)
        return [
            Completion(
                tokens=self.rng.integers(0, self.vocab, n).astype(np.int32),
                logprobs=np.full(n, lp, dtype=np.float32),
                text="",
                finish_reason="length" if n >= a.max_tokens else "stop",
                weight_version=version,
            )
            for n in lengths
        ]


class RandomReward:
    """Stands in for executor + verifier: a seeded random 0/1 reward per sample."""

    stage = "verifier"
    input_stream = N.ROLLOUTS
    input_type = Rollout

    async def handle(self, rollout: Rollout) -> list[Output]:
        if rollout.task.split != "train":
            return []  # the scheduler's start-up evaluation round: not part of the workload
        rng = np.random.default_rng(int(rollout.id[:8], 16))
        rewards = [float(r) for r in rng.integers(0, 2, len(rollout.samples))]
        traj = Trajectory(
            id=new_id(),
            created_at=now(),
            policy_version=rollout.policy_version,
            rollout=rollout,
            outcomes=[],
            rewards=rewards,
        )
        return [Output(N.TRAJECTORIES, traj)]


async def run_mode(url: str, mode: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    staleness = args.staleness if mode == "async" else 0
    run = f"bench-{mode}-{new_id()[:6]}"
    config = load_config(
        None,
        [
            f"run.name={run}",
            f"run.redis_url={url}",
            f"run.work_dir={work / run}",
            f"run.seed={args.seed}",
            "auth.enabled=false",
            "model.spec=tiny",
            f"scheduler.group_size={args.group_size}",
            f"scheduler.max_new_tokens={args.max_tokens}",
            "scheduler.max_backlog=256",
            "scheduler.eval_every=0",
            "scheduler.eval_items=1",
            f"generator.concurrency={args.concurrency}",
            f"learner.groups_per_step={args.groups_per_step}",
            f"learner.max_staleness={staleness}",
            f"learner.max_steps={args.steps}",
            "learner.lr=1e-4",
            "learner.keep_last=2",
            f"learner.threads={args.threads}",
            "queues.block_ms=50",
            "queues.trim_interval_s=0",
        ],
    )
    tokenizer = load_tokenizer(resolve_model("tiny"))
    engine = LongTailEngine(len(tokenizer), args)
    client = RedisClient(url)
    ctx = ActorContext(config, client, Names(run))
    started = time.monotonic()
    try:
        async with trio.open_nursery() as nursery:
            # sync mode: the shipped generator's version gate (actors.generator.VersionGate)
            gate = VersionGate() if mode == "sync" else None
            await nursery.start(serve_weight_updates, ctx, engine, gate)
            generator = Generator(engine, tokenizer)
            generator.gate = gate
            nursery.start_soon(
                lambda: ctx.serve(
                    generator,
                    concurrency=args.concurrency,
                    time_limit_s=120,
                )
            )
            nursery.start_soon(
                lambda: ctx.serve(RandomReward(), concurrency=args.concurrency, time_limit_s=60)
            )
            nursery.start_soon(scheduler_actor.serve, ctx)
            with trio.fail_after(args.timeout_s):
                await learner_actor.serve(ctx)  # returns after learner.max_steps steps
            nursery.cancel_scope.cancel()
        total_s = time.monotonic() - started
        rows = await client.call(client.sync.xrange, ctx.names.stream(N.METRICS))
        dropped = int(await client.call(client.sync.get, ctx.names.counter("dropped_stale")) or 0)
    finally:
        client.close()
    metrics = sorted((decode(f[b"d"], StepMetrics) for _, f in rows), key=lambda m: m.step)
    # Window: from the end of step 1's metrics to the last step's metrics (same for both modes)
    window = metrics[-1].created_at - metrics[0].created_at
    later = metrics[1:]
    step_s = sum(m.step_seconds for m in later)
    wait_s = sum(m.wait_seconds for m in later)
    return {
        "mode": mode,
        "max_staleness": staleness,
        "steps": len(metrics),
        "window_s": round(window, 3),
        "seconds_per_step": round(window / max(len(later), 1), 4),
        "learner_busy_fraction": round(step_s / window, 4),
        "learner_wait_fraction": round(wait_s / window, 4),
        "mean_step_s": round(step_s / max(len(later), 1), 4),
        "learner_not_waiting_fraction": round(1 - wait_s / window, 4),
        "tokens_per_s": round(sum(m.tokens for m in later) / window, 1),
        "max_staleness_seen": max(m.max_staleness_seen for m in metrics),
        "dropped_stale": dropped,
        "samples_trained": sum(m.samples for m in metrics),
        "tokens_trained": sum(m.tokens for m in metrics),
        "total_s_including_start": round(total_s, 2),
        "wait_s_per_step": [round(m.wait_seconds, 3) for m in metrics],
        "step_s_per_step": [round(m.step_seconds, 3) for m in metrics],
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "redis").mkdir()
        with ServerProcess(data_dir=work / "redis") as server:
            runs: dict[str, list[dict[str, Any]]] = {"sync": [], "async": []}
            for _ in range(args.repeats):  # interleaved, so both modes see the same load
                for mode in ("sync", "async"):
                    runs[mode].append(await run_mode(server.url, mode, args, work))
    # per mode, the run with the median seconds per step
    results = {
        m: sorted(r, key=lambda x: x["seconds_per_step"])[len(r) // 2] for m, r in runs.items()
    }
    pairs = [
        round(s["seconds_per_step"] / a["seconds_per_step"], 3)
        for s, a in zip(runs["sync"], runs["async"], strict=True)
    ]
    return {
        "benchmark": "async_vs_sync",
        "workload": {
            "steps": args.steps,
            "groups_per_step": args.groups_per_step,
            "group_size": args.group_size,
            "completion_tokens": f"lognormal(median={args.median_tokens}, sigma={args.sigma}), "
            f"cap {args.max_tokens}",
            "seconds_per_token": args.seconds_per_token,
            "generator_concurrency": args.concurrency,
            "async_max_staleness": args.staleness,
            "model": "tiny (random Llama, SmolLM2 tokenizer)",
            "learner_threads": args.threads,
        },
        "machine": {"python": platform.python_version(), "cpus": __import__("os").cpu_count()},
        "sync": results["sync"],
        "async": results["async"],
        "speedup_async_over_sync": round(
            results["sync"]["seconds_per_step"] / results["async"]["seconds_per_step"], 3
        ),
        "speedup_tokens_per_s": round(
            results["async"]["tokens_per_s"] / results["sync"]["tokens_per_s"], 3
        ),
        "learner_busy_fraction": results["async"]["learner_busy_fraction"],
        "speedup_per_repeat": pairs,
        "learner_busy_fraction_per_repeat": [a["learner_busy_fraction"] for a in runs["async"]],
        "targets": {"speedup_async_over_sync": 2.0, "learner_busy_fraction": 0.95},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object (the default)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--groups-per-step", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--median-tokens", type=float, default=12.0)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--seconds-per-token", type=float, default=0.01)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--staleness", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="sync/async pairs, interleaved")
    p.add_argument("--timeout-s", type=float, default=600)
    args = p.parse_args()
    configure_logging(actor="async_vs_sync", level="warning", stream=sys.stderr)
    result = trio.run(main_async, args)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
