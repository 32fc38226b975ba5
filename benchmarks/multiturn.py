"""Claim: multi-turn episodes cost little beyond their sandbox commands; the per-turn work-dir
snapshot (what lets any executor replica take the next turn) is a small share of a turn.

One run, on a Redis started here (or ``--redis-url``): ``--episodes`` terminal-domain
episodes of ``--group`` members and ``--turns`` model turns each go through the real
generator, executor (process backend, resident bubblewrap sandboxes) and verifier actors,
in this process, talking only through Redis Streams. The model is a scripted engine (fixed
shell commands, tokenised with the real tokenizer): this measures the episode machinery,
not a model. Each turn runs ``echo step >> log.txt; wc -l < log.txt``; the last also writes
the answer and says ``<done>``, and the hidden check runs. Measured twice, interleaved in
blocks: with ``executor.episode_snapshots`` on (the default) and off.

Reported per mode: member-turns per second (sandbox commands of the model's turns,
wall time from the first task to the last trajectory), episodes per second, and the p50 /
p99 of one episode's wall time (all tasks are published at once, so it includes queueing
behind the other episodes). Simplifications: the generator takes no time (no model);
one executor and one generator with ``--concurrency`` handlers each.

    .venv/bin/python benchmarks/multiturn.py [--episodes 8] [--group 4] [--turns 4] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from typing import Any

import numpy as np
import trio

from streamrl.actors.episodes import EpisodeSessions
from streamrl.actors.executor import Executor, Sandboxes
from streamrl.actors.generator import Generator
from streamrl.actors.scheduler import make_task
from streamrl.actors.verifier import Verifier
from streamrl.config.schema import DomainConfig
from streamrl.domains.registry import get_domain
from streamrl.inference.engine import Completion
from streamrl.models import load_tokenizer, resolve_model
from streamrl.protocol import names as N
from streamrl.protocol.messages import Sampling, Trajectory
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import decode, encode
from streamrl.queues.server import server_url
from streamrl.queues.streams import FIELD, ConsumerSettings, Producer, open_stream_consumer
from streamrl.runtime.policies import Policies, RetryPolicy
from streamrl.runtime.serve import ActorRuntime, RuntimeSettings

STEP = "```sh\necho step >> log.txt; wc -l < log.txt\n```"


class ScriptedEngine:
    """Replies fixed per turn (the turn read off the prompt's assistant headers)."""

    def __init__(self, tokenizer: Any, turns: int, answer_file: str) -> None:
        self.tokenizer, self.turns = tokenizer, turns
        self.last = f"```sh\necho step >> log.txt; echo 0 > {answer_file}\n```\n<done>"

    @property
    def weight_version(self) -> int:
        return 0

    async def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Completion]:
        turn = self.tokenizer.decode(prompts[0]).count("<|im_start|>assistant")
        text = self.last if turn >= self.turns else STEP
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        ids = np.array([*ids, self.tokenizer.eos_token_id], dtype=np.int32)
        return [Completion(tokens=ids, logprobs=np.full(len(ids), -1.0, np.float32), text=text,
                           finish_reason="stop", weight_version=0) for _ in prompts]

    async def update_weights(self, path: Any, version: int) -> None:
        pass


async def serve(actor: Any, client: RedisClient, names: N.Names, concurrency: int, *,
                task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    settings = ConsumerSettings(block_ms=50, trim_interval_s=0)
    async with open_stream_consumer(client, names, actor.input_stream, stage=actor.stage,
                                    settings=settings) as consumer:
        runtime = ActorRuntime(consumer, actor, Policies(retry=RetryPolicy(2, 0.05, 0.1)),
                               RuntimeSettings(concurrency=concurrency))
        await runtime.serve(task_status=task_status)


async def one_run(url: str, args: argparse.Namespace, snapshots: bool, tokenizer: Any,
                  sandboxes: Sandboxes) -> dict[str, float]:
    client = RedisClient(url)
    names = N.Names(f"mt{uuid.uuid4().hex[:8]}")
    domain = get_domain("terminal")
    item = next(i for i in domain.load_items("train") if i.kind == "count_matching")
    answer = item.prompt.split("number to ")[1].split(".")[0]
    executor = Executor(sandboxes, EpisodeSessions(sandboxes, snapshots=snapshots),
                        {"terminal": DomainConfig(max_turns=args.turns)})
    actors = [Generator(ScriptedEngine(tokenizer, args.turns, answer), tokenizer), executor,
              Verifier()]
    tasks = [make_task("terminal", item, split="train", group_size=args.group,
                       sampling=Sampling(max_new_tokens=64), version=0)
             for _ in range(args.episodes)]
    try:
        async with trio.open_nursery() as nursery:
            for actor in actors:
                await nursery.start(serve, actor, client, names, args.concurrency)
            started = time.time()
            await Producer(client, names).publish(N.TASKS, [encode(t) for t in tasks])
            while True:
                n = await client.call(client.sync.xlen, names.stream(N.TRAJECTORIES))
                if n >= args.episodes:
                    break
                await trio.sleep(0.02)
            elapsed = time.time() - started
            nursery.cancel_scope.cancel()
        raw = await client.call(client.sync.xrange, names.stream(N.TRAJECTORIES))
        trajs = [decode(f[FIELD], Trajectory) for _, f in raw]
    finally:
        client.close()
    assert all(len(s.turns) == args.turns for t in trajs for s in t.rollout.samples)
    durations = [t.created_at - started for t in trajs]  # every task went in at `started`
    member_turns = args.episodes * args.group * args.turns
    return {"seconds": elapsed, "member_turns_per_s": member_turns / elapsed,
            "episodes_per_s": args.episodes / elapsed,
            "episode_p50_s": statistics.median(durations),
            "episode_p99_s": float(np.percentile(durations, 99))}


async def run(url: str, args: argparse.Namespace) -> dict[str, Any]:
    tokenizer = load_tokenizer(resolve_model("tiny"))
    sandboxes = Sandboxes("process")
    runs: dict[str, list[dict[str, float]]] = {"snapshots": [], "no_snapshots": []}
    async with sandboxes.opened():  # the backends' warm pools, closed on exit
        await one_run(url, argparse.Namespace(**{**vars(args), "episodes": 1}), True,
                      tokenizer, sandboxes)  # warm-up: the sandbox pool, imports
        for _ in range(args.blocks):
            for mode in runs:
                runs[mode].append(await one_run(url, args, mode == "snapshots", tokenizer,
                                                sandboxes))
    out: dict[str, Any] = {}
    for mode, results in runs.items():
        out[mode] = {k: round(statistics.median(r[k] for r in results), 3) for k in results[0]}
    out["snapshot_overhead"] = round(out["no_snapshots"]["member_turns_per_s"]
                                     / out["snapshots"]["member_turns_per_s"] - 1, 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--redis-url", help="use this server instead of starting one")
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4, help="handlers per actor")
    parser.add_argument("--blocks", type=int, default=2, help="runs per mode (median)")
    args = parser.parse_args()
    report: dict[str, Any] = {"benchmark": "multiturn", "episodes": args.episodes,
                              "group": args.group, "turns": args.turns,
                              "concurrency": args.concurrency}
    with server_url(args.redis_url) as url:
        report.update(trio.run(run, url, args))
    if args.json:
        print(json.dumps(report))
    else:
        print(json.dumps(report, indent=2), file=sys.stderr if args.json else sys.stdout)


if __name__ == "__main__":
    main()
