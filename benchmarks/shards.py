"""Claim: on a Redis Cluster, splitting a run into shards (``queues.shards``) costs one
consumer process little: the queue hop through a :class:`queues.shards.ShardedConsumer`
over 3 shards runs at a rate close to the one-slot :class:`queues.streams.StreamConsumer`
(the baseline, same run), and the scheduler's admission across slots (reserve in the run's
slot, then ``publish_once`` per shard) costs a few round trips more than the one-slot script.
JSON out.

Setup: a 3-node loopback cluster (``queues.server.ClusterProcess``: password, AOF
everysec, no replicas) started here, or ``--redis-url``. Definitions:

- ``hop_per_s[shards]``: ``--messages`` 4 KB entries pre-filled (routed by key over the
  shards, not timed); one consumer (``queues.shards.open_consumer``: a plain consumer for 1
  shard, a sharded one otherwise) reads up to ``--in-flight`` entries and hands each off in
  its own trio task with ``complete`` (one 4 KB output, a dedup key), as
  ``runtime.serve`` does. Rate = messages / wall time from the first read to the last
  hand-off applied; checked: every output published, nothing pending.
- ``admit_ms_p50[shards]``: median wall time of one counted admission of ``--batch`` 1 KB
  tasks: ``Producer.publish_counted`` (1 shard, one script) or
  ``queues.shards.publish_counted_routed`` (n shards), ``--admissions`` times.

    .venv/bin/python benchmarks/shards.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import trio

from streamrl.protocol import names as N
from streamrl.queues.client import RedisClient
from streamrl.queues.server import ClusterProcess
from streamrl.queues.shards import Consumer, open_consumer, publish_counted_routed, publish_routed
from streamrl.queues.stats import group_state, stream_length
from streamrl.queues.streams import ConsumerSettings, Handoff, Producer


def payload(i: int, size: int) -> bytes:
    return i.to_bytes(8, "little") + os.urandom(size - 8)


async def prefill(client: RedisClient, names: N.Names, n: int, size: int) -> None:
    for start in range(0, n, 1000):
        items = [(f"k{i}", payload(i, size)) for i in range(start, min(n, start + 1000))]
        if names.sharded:
            await publish_routed(client, names, N.TASKS, items, names.shards)
        else:
            await Producer(client, names).publish(N.TASKS, [p for _, p in items])


async def hop(client: RedisClient, shards: int, args: argparse.Namespace) -> float:
    names = N.Names(f"bench{uuid.uuid4().hex[:8]}", shards=shards)
    n = args.messages
    await prefill(client, names, n, args.size)
    settings = ConsumerSettings(block_ms=1000, dedup_ttl_s=600)
    async with open_consumer(client, names, N.TASKS, stage="b", settings=settings) as c:
        out = c.names.stream(N.ROLLOUTS)
        in_flight = read = 0
        freed = trio.Event()

        async def hand_off(c: Consumer, entry_id: str, body: bytes) -> None:
            nonlocal in_flight
            await c.complete(Handoff(entry_id, c.names.dedup("b", entry_id), [(out, body)]))
            in_flight -= 1
            freed.set()

        started = time.perf_counter()
        async with trio.open_nursery() as nursery:
            while read < n:
                while in_flight >= args.in_flight:
                    freed = trio.Event()
                    await freed.wait()
                for d in await c.read(args.in_flight - in_flight):
                    read += 1
                    in_flight += 1
                    nursery.start_soon(hand_off, c, d.entry_id, d.payload or b"")
        elapsed = time.perf_counter() - started
    published = await stream_length(client, names, N.ROLLOUTS)
    pending = (await group_state(client, names, N.TASKS, "generator")).pending
    if published != n or pending:
        raise RuntimeError(f"{published} outputs of {n}, {pending} pending")
    return n / elapsed


async def admit(client: RedisClient, shards: int, args: argparse.Namespace) -> float:
    names = N.Names(f"bench{uuid.uuid4().hex[:8]}", shards=shards)
    times = []
    count = 0
    for a in range(args.admissions):
        items = [(f"e{a}-{i}", payload(i, 1024)) for i in range(args.batch)]
        started = time.perf_counter()
        if names.sharded:
            added = await publish_counted_routed(
                client, names, N.TASKS, items, names.admitted, count
            )
        else:
            added = await Producer(client, names).publish_counted(
                N.TASKS, [p for _, p in items], names.admitted, count
            )
        times.append(time.perf_counter() - started)
        count += added
    if count != args.admissions * args.batch:
        raise RuntimeError(f"admitted {count}")
    return statistics.median(times) * 1000


async def measure(url: str, args: argparse.Namespace) -> dict[str, Any]:
    client = RedisClient(url)
    try:
        hops: dict[int, list[float]] = {s: [] for s in args.shards}
        admits: dict[int, list[float]] = {s: [] for s in args.shards}
        for _ in range(args.repeat):  # interleaved: load changes hit every variant alike
            for s in args.shards:
                hops[s].append(await hop(client, s, args))
                admits[s].append(await admit(client, s, args))
        return {
            "hop_per_s": {s: round(statistics.median(v)) for s, v in hops.items()},
            "hop_per_s_runs": {s: [round(x) for x in v] for s, v in hops.items()},
            "admit_ms_p50": {s: round(statistics.median(v), 2) for s, v in admits.items()},
        }
    finally:
        client.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--redis-url", help="a redis+cluster:// URL (default: start one here)")
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--in-flight", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--admissions", type=int, default=50)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    if args.redis_url:
        result = trio.run(measure, args.redis_url, args)
    else:
        with tempfile.TemporaryDirectory() as tmp, ClusterProcess(Path(tmp)) as cluster:
            result = trio.run(measure, cluster.url, args)
    result.update(
        messages=args.messages, size=args.size, in_flight=args.in_flight, batch=args.batch,
        load_avg_before=round(load, 2), load_avg_after=round(os.getloadavg()[0], 2),
    )  # fmt: skip
    print(json.dumps(result, indent=2 if not args.json else None))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
