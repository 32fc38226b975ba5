"""Claim: a multi-turn episode's turn costs the same on the wire at turn 32 as at turn 1
(context by reference, runtime/contexts.py), where whole messages grew with the context.

One run, on a Redis started here (or ``--redis-url``): one episode of ``--group`` members
and ``--turns`` turns, each adding ``--tokens`` tokens per member, goes through the real
generator, executor (process sandbox, no command run: the model never writes one) and
verifier actors and their runtime, talking only through Redis Streams. The model is
:class:`streamrl.testing.episodes.BulkEngine` (synthetic tokens, deterministic in the
context). Bytes per turn are summed from what the hand-offs of that turn write: the
generator's rollout and the executor's next task (or the episode's end) with its stored
context part (:class:`streamrl.testing.episodes.WireMeter`); the verifier's trajectory,
whole, is written once and reported apart (``final_bytes``). Redis INFO's
``total_net_input_bytes`` over the run is reported beside the sum as a cross-check.

The old wire in the same run: the same episode through the same handlers with whole
messages between them (what the runtime wrote before), each message's encoded size; the
trajectories of both must be the same, token for token (``same_tokens``).

    .venv/bin/python benchmarks/episode_wire.py [--turns 32] [--group 8] [--tokens 8192] [--json]
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from typing import Any

import trio

from streamrl.actors.episodes import EpisodeSessions
from streamrl.actors.executor import Executor, Sandboxes
from streamrl.actors.generator import Generator
from streamrl.actors.scheduler import make_task
from streamrl.actors.verifier import Verifier
from streamrl.config.schema import DomainConfig
from streamrl.domains.registry import get_domain
from streamrl.models import load_tokenizer, resolve_model
from streamrl.protocol import names as N
from streamrl.protocol.messages import Sampling, Trajectory
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import decode, encode
from streamrl.queues.payloads import PayloadLimits, resolve
from streamrl.queues.server import server_url
from streamrl.queues.streams import FIELD, ConsumerSettings, Producer, open_stream_consumer
from streamrl.runtime.policies import Policies, RetryPolicy
from streamrl.runtime.serve import ActorRuntime, RuntimeSettings
from streamrl.testing.episodes import BulkEngine, WireMeter, bulk_domain, play_in_process


async def serve(actor: Any, client: RedisClient, names: N.Names, meter: WireMeter, *,
                task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    settings = ConsumerSettings(block_ms=50, trim_interval_s=0)
    async with open_stream_consumer(client, names, actor.input_stream, stage=actor.stage,
                                    settings=settings) as consumer:
        meter.wrap(consumer)
        runtime = ActorRuntime(consumer, actor, Policies(retry=RetryPolicy(2, 0.05, 0.1)),
                               RuntimeSettings(concurrency=2))
        await runtime.serve(task_status=task_status)


def executor(domain: str, turns: int) -> Executor:
    sandboxes = Sandboxes("process")
    return Executor(sandboxes, EpisodeSessions(sandboxes), {domain: DomainConfig(max_turns=turns)})


async def run(url: str, args: argparse.Namespace) -> dict[str, Any]:
    tokenizer = load_tokenizer(resolve_model("tiny"))
    client = RedisClient(url)
    names = N.Names(f"wire{uuid.uuid4().hex[:8]}")
    with bulk_domain(args.turns, "bulk_episode_wire") as domain:
        item = next(i for i in get_domain(domain).load_items("train"))
        task = make_task(domain, item, split="train", group_size=args.group,
                         sampling=Sampling(max_new_tokens=args.tokens), version=0)
        # the old wire: whole messages between the same handlers
        ex_old = executor(domain, args.turns)
        async with ex_old.sandboxes.opened():
            started = time.time()
            old, old_turns = await play_in_process(Generator(BulkEngine(args.tokens), tokenizer),
                                                   ex_old, task, args.turns)
            old_s = time.time() - started
        # the new wire: through Redis, by reference
        meter, ex = WireMeter(), executor(domain, args.turns)
        net_before = int((await client.call(client.sync.info, "stats"))["total_net_input_bytes"])
        async with ex.sandboxes.opened(), trio.open_nursery() as nursery:
            for actor in (Generator(BulkEngine(args.tokens), tokenizer), ex, Verifier()):
                await nursery.start(serve, actor, client, names, meter)
            started = time.time()
            await Producer(client, names).publish(N.TASKS, [encode(task)])
            key = names.stream(N.TRAJECTORIES)
            while not await client.call(client.sync.xlen, key):
                await trio.sleep(0.05)
            new_s = time.time() - started
            nursery.cancel_scope.cancel()
        net = int((await client.call(client.sync.info, "stats"))["total_net_input_bytes"])
        [(entry, fields)] = await client.call(client.sync.xrange, key)
        [got] = resolve(client.sync, [(entry, fields[FIELD])], PayloadLimits(), stream_key=key)
        assert got.payload is not None, got.error
        traj = decode(got.payload, Trajectory)
        left = len(await client.call(client.sync.keys, names.context("*")))
    client.close()
    same = [(s.tokens, s.logprobs, s.mask, s.versions, s.turns) for s in traj.rollout.samples] \
        == [(s.tokens, s.logprobs, s.mask, s.versions, s.turns) for s in old.rollout.samples]
    first, last = meter.turns[1], meter.turns[args.turns]
    return {
        "new": {"turn_1_bytes": first, "turn_last_bytes": last,
                "last_over_first": round(last / first, 3),
                "total_turn_bytes": sum(meter.turns.values()), "final_bytes": meter.final,
                "largest_payload_bytes": meter.largest,
                "redis_net_input_bytes": net - net_before, "seconds": round(new_s, 2)},
        "old": {"turn_1_bytes": old_turns[1], "turn_last_bytes": old_turns[args.turns],
                "last_over_first": round(old_turns[args.turns] / old_turns[1], 3),
                "total_turn_bytes": sum(old_turns.values()), "seconds": round(old_s, 2)},
        "last_over_first": round(last / first, 3),
        "context_tokens_per_member": len(traj.rollout.samples[0].tokens) // 4,
        "same_tokens": same,
        "context_keys_left": left,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--redis-url", help="use this server instead of starting one")
    parser.add_argument("--turns", type=int, default=32)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per member per turn")
    args = parser.parse_args()
    report: dict[str, Any] = {"benchmark": "episode_wire", "turns": args.turns,
                              "group": args.group, "tokens_per_turn": args.tokens}
    with server_url(args.redis_url) as url:
        report.update(trio.run(run, url, args))
    print(json.dumps(report) if args.json else json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
