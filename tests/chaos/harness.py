"""Chaos harness: the real actor processes of one run, supervised by the test itself.

A :class:`Scenario` describes a run (Redis URL, how many training groups, replicas, config
overrides on top of ``configs/tiny.toml``); :func:`open_pipeline` starts one process per
actor (``python -m streamrl run <role>``) and keeps them running: a process that exits is
started again, and every exit that the harness did not cause itself is recorded in
:attr:`ActorProcess.crashes`. While it runs the test may

- kill processes with SIGKILL (:func:`serve_chaos`: a random one holding work, every few
  dozen entries the pipeline publishes),
- plant malformed entries in the work streams (:func:`plant_poison`),
- record what passes through the streams before trimming removes it (:class:`Recorder`),

and at the end :meth:`Pipeline.stop` stops every process gracefully (SIGTERM) and
:func:`inspect_run` gathers what the checks need: admitted task ids, the learner's ledger,
metrics, pending counts of every group, dead letters.

Only the Redis URL ties a scenario to a server, so the same harness runs against one Redis
server or a Redis Cluster (``redis+cluster://`` URL). ``Scenario.shards`` > 1 runs the
pipeline split into shards (``queues.shards``): poison is planted in every shard, and the
recorder and the checks read every shard (entry ids qualified by the shard, ``<k>:<id>``).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import redis
import trio

from streamrl.config.schema import load_config
from streamrl.learner.weights import latest_version
from streamrl.protocol import names as N
from streamrl.protocol.messages import StepMetrics, Task, Trajectory, WeightsPublished
from streamrl.queues.acl import Credentials
from streamrl.queues.client import RedisClient, RedisURL
from streamrl.queues.codec import DeadLetter, MessageError, decode, encode
from streamrl.queues.shards import qualify
from streamrl.queues.stats import group_state, stream_length
from streamrl.runtime.auth import apply_role_users, credentials_for_up
from streamrl.testing.wait import wait_until

REPO = Path(__file__).resolve().parents[2]
ROLES = ("scheduler", "generator", "executor", "verifier", "learner")
PIPELINE_STREAMS = (N.TASKS, N.ROLLOUTS, N.EXECUTED, N.TRAJECTORIES)


@dataclass
class Scenario:
    redis_url: str
    run: str
    work_dir: Path
    items: int
    """Training groups the scheduler admits (``scheduler.max_train_groups``)."""
    group_size: int = 1
    groups_per_step: int = 25
    replicas: dict[str, int] = field(
        default_factory=lambda: {"generator": 2, "executor": 2, "verifier": 2}
    )
    overrides: list[str] = field(default_factory=list)
    """Extra ``section.key=value`` settings, applied after the scenario's own."""
    shards: int = 1
    """``queues.shards`` of the run (1: the default layout)."""

    def __post_init__(self) -> None:
        if self.items % self.groups_per_step:
            raise ValueError("items must be a multiple of groups_per_step (no partial batch)")

    def settings(self) -> list[str]:
        return [
            f"run.name={self.run}",
            f"run.work_dir={self.work_dir}",
            "model.spec=tiny",
            f"scheduler.group_size={self.group_size}",
            f"scheduler.max_train_groups={self.items}",
            "scheduler.max_new_tokens=4",
            "scheduler.max_backlog=48",
            "scheduler.eval_every=0",  # one held-out round at start, no monitor needed
            "scheduler.eval_items=2",
            "generator.concurrency=16",
            f"learner.groups_per_step={self.groups_per_step}",
            "learner.max_staleness=1000000",  # nothing is legitimately dropped as stale
            "learner.keep_last=2",
            "queues.block_ms=250",
            "queues.reclaim_min_idle_ms=3000",
            "queues.reclaim_interval_s=0.5",
            "queues.heartbeat_interval_s=0.5",
            # a kill charges a delivery to every entry its process held, started or not, and
            # under load (CI) the kills come faster than a restarted verifier or learner gets
            # through what it holds: at the default limit of 5, entries no handler choked on
            # were dead-lettered as crash loops (22 of 300 groups in one run). The crash-loop
            # guard has tests of its own; here nothing may be lost to the kills themselves.
            "queues.max_deliveries=1000",
            "retry.backoff_s=0.1",
            "retry.max_backoff_s=1.0",
            *([f"queues.shards={self.shards}"] if self.shards > 1 else []),
            *self.overrides,
        ]

    @property
    def names(self) -> N.Names:
        return N.Names(self.run, shards=self.shards)

    @property
    def weights_root(self) -> Path:
        return self.work_dir / "weights"


# --------------------------------------------------------------------------- processes


@dataclass
class ActorProcess:
    """One actor process, restarted whenever it exits until :meth:`stop`."""

    role: str
    index: int
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    process: trio.Process | None = None
    started_at: float = 0.0
    ready_at: float | None = None
    """When the current process logged "actor ready" (set up, taking work)."""
    _log_offset: int = 0
    pids: list[int] = field(default_factory=list)
    kills: int = 0
    crashes: list[int] = field(default_factory=list)
    """Exit codes of exits the harness did not cause (a graceful stop is not one)."""
    stop_code: int | None = None
    _killing: bool = False
    _stopping: bool = False
    _exited: trio.Event = field(default_factory=trio.Event)

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.returncode is None

    @property
    def uptime(self) -> float:
        return time.monotonic() - self.started_at if self.alive else 0.0

    def ready_for(self) -> float:
        """Seconds since the current process became ready (0 if it is not, or not alive)."""
        if not self.alive:
            return 0.0
        if self.ready_at is None:
            with self.log_path.open("rb") as log:
                log.seek(self._log_offset)
                if b'"event": "actor ready"' not in log.read():
                    return 0.0
            self.ready_at = time.monotonic()
        return time.monotonic() - self.ready_at

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        first = True
        while not self._stopping:
            with self.log_path.open("ab") as log:
                self._log_offset = log.tell()
                self.ready_at = None
                self.process = await trio.lowlevel.open_process(
                    self.argv,
                    env=self.env,
                    cwd=REPO,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            self.started_at = time.monotonic()
            self.pids.append(self.process.pid)
            self._exited = trio.Event()
            if first:
                first = False
                task_status.started()
            code = await self.process.wait()
            self._exited.set()
            if self._stopping:
                self.stop_code = code
                return
            if not self._killing:
                self.crashes.append(code)
                await trio.sleep(1.0)  # a crash loop should not eat the machine
            self._killing = False

    async def kill(self) -> None:
        """SIGKILL the process and wait until it is gone (``serve`` starts it again)."""
        if not self.alive:
            return
        assert self.process is not None
        self._killing = True
        self.process.send_signal(signal.SIGKILL)
        self.kills += 1
        await self._exited.wait()

    async def stop(self, timeout_s: float) -> None:
        """SIGTERM (graceful drain), SIGKILL after ``timeout_s``."""
        self._stopping = True
        if not self.alive:
            return
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        with trio.move_on_after(timeout_s):
            await self._exited.wait()
            return
        self.process.kill()
        await self._exited.wait()
        self.stop_code = -9

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""


@dataclass
class Pipeline:
    scenario: Scenario
    actors: list[ActorProcess]
    credentials: dict[str, Credentials] = field(default_factory=dict)
    """The role users' credentials (auth.enabled), e.g. to create them again after Redis
    restarted: users made with ACL SETUSER are not persisted."""

    async def apply_users(self) -> None:
        config = load_config(REPO / "configs" / "tiny.toml", self.scenario.settings())
        await apply_role_users(config, self.scenario.redis_url, self.credentials)

    def by_role(self, role: str) -> list[ActorProcess]:
        return [a for a in self.actors if a.role == role]

    def kills_by_role(self) -> dict[str, int]:
        return {r: sum(a.kills for a in self.by_role(r)) for r in ROLES}

    def crashes(self) -> dict[str, list[int]]:
        return {a.name: a.crashes for a in self.actors if a.crashes}

    def current_pids(self) -> dict[str, int | None]:
        return {a.name: a.process.pid if a.alive and a.process else None for a in self.actors}

    async def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Until every process is ready (e.g. the last one killed has started again)."""
        await wait_until(
            lambda: all(a.ready_for() > 0 for a in self.actors), timeout=timeout_s, interval=0.2
        )

    async def stop(self, timeout_s: float = 90.0) -> None:
        """SIGTERM every process at once (graceful: drain, settle, exit 0). The actors bound
        their own drain at 60 s (``runtime.process.run_actor``), so a SIGKILL here after
        ``timeout_s`` is an actor that did not keep its own bound."""
        async with trio.open_nursery() as nursery:
            for a in self.actors:
                nursery.start_soon(a.stop, timeout_s)

    def logs(self, chars: int = 2000) -> str:
        return "\n".join(f"===== {a.name}\n{a.log_tail(chars)}" for a in self.actors)


def _actors(scenario: Scenario, credentials: dict[str, Credentials]) -> list[ActorProcess]:
    logs = scenario.work_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/tmp"),
        "PYTHONUNBUFFERED": "1",
        "STREAMRL_REDIS_URL": scenario.redis_url,  # keeps the password off command lines
    }
    if os.environ.get("STREAMRL_CACHE"):
        env["STREAMRL_CACHE"] = os.environ["STREAMRL_CACHE"]
    args = ["--config", str(REPO / "configs" / "tiny.toml")]
    for s in scenario.settings():
        args += ["--set", s]
    actors = []
    for role in ROLES:
        for i in range(scenario.replicas.get(role, 1)):
            argv = [sys.executable, "-m", "streamrl", "run", role, *args]
            role_env = env
            if credentials:  # its role's own ACL user (auth.enabled): no admin password
                bare = RedisURL(scenario.redis_url).without_credentials().url
                password = {f"STREAMRL_PASSWORD_{role.upper()}": credentials[role].password}
                role_env = {**env, "STREAMRL_REDIS_URL": bare, **password}
            actors.append(ActorProcess(role, i, argv, role_env, logs / f"{role}-{i}.log"))
    return actors


@asynccontextmanager
async def open_pipeline(scenario: Scenario) -> AsyncIterator[Pipeline]:
    """Start every actor process; on exit stop them all (SIGTERM, then SIGKILL)."""
    from streamrl.models import resolve_model

    await trio.to_thread.run_sync(resolve_model, "tiny")  # build the cached model only once
    config = load_config(REPO / "configs" / "tiny.toml", scenario.settings())
    credentials = credentials_for_up(config, {}) if config.auth.enabled else {}
    await apply_role_users(config, scenario.redis_url, credentials)
    pipeline = Pipeline(scenario, _actors(scenario, credentials), credentials)
    async with trio.open_nursery() as nursery:
        try:
            for actor in pipeline.actors:
                await nursery.start(actor.serve)
            yield pipeline
        finally:
            with trio.CancelScope(shield=True):
                await pipeline.stop(timeout_s=30.0)
            nursery.cancel_scope.cancel()


# --------------------------------------------------------------------------- chaos


@dataclass
class ChaosLog:
    kills: list[tuple[int, str]] = field(default_factory=list)
    """(pipeline hops published when it was killed, process name), in kill order."""


CONSUMES = {
    role: stream for stream, role in N.GROUP_OF_STREAM.items() if stream in PIPELINE_STREAMS
}
"""The pipeline stream each consuming role reads (the scheduler reads none of them)."""


async def published(client: RedisClient, names: N.Names) -> int:
    """Entries ever added to the pipeline streams (``entries-added``: trimming does not lower
    it), summed over the shards: each one is a hop some process finished and acknowledged."""
    total = 0
    for layout in names.layouts():
        for stream in PIPELINE_STREAMS:
            with contextlib.suppress(redis.ResponseError):  # no such stream yet
                info = await client.call(client.sync.xinfo_stream, layout.stream(stream))
                total += int(info["entries-added"])
    return total


async def holding(client: RedisClient, names: N.Names, role: str) -> set[int | str]:
    """Who among ``role``'s processes holds delivered, unacknowledged entries of the stream
    it consumes: pids, from consumer names ``host:pid:nonce`` (queues.streams), or the fixed
    name of a role with one consumer (the learner's ``learner-0``)."""
    held: set[int | str] = set()
    for layout in names.layouts():
        with contextlib.suppress(redis.ResponseError):  # no group yet
            consumers = await client.call(
                client.sync.xinfo_consumers,
                layout.stream(CONSUMES[role]),
                N.GROUP_OF_STREAM[CONSUMES[role]],
            )
            for c in consumers:
                name = c["name"].decode() if isinstance(c["name"], bytes) else str(c["name"])
                if int(c["pending"]) > 0:
                    parts = name.split(":")
                    held.add(int(parts[-2]) if len(parts) >= 3 and parts[-2].isdigit() else name)
    return held


def _mid_work(actor: ActorProcess, held: set[int | str], replicas: int) -> bool:
    """``actor`` holds entries: by its pid, or as the one process of its role (fixed name)."""
    if actor.process is None:
        return False
    return actor.process.pid in held or (replicas == 1 and any(isinstance(h, str) for h in held))


async def serve_chaos(
    pipeline: Pipeline,
    client: RedisClient,
    rng: random.Random,
    log: ChaosLog,
    *,
    every_hops: tuple[int, int] = (30, 70),
    patience_hops: int = 30,
    poll_s: float = 0.1,
) -> None:
    """SIGKILL one process after every ``every_hops`` (uniform) entries published on the
    pipeline streams. The roles take turns (each shuffled round kills every role once); of
    the role whose turn it is, a process that is ready (logged "actor ready") and, for a
    consuming role, holds entries it has not acknowledged yet (killed mid-work: what it held
    must be reclaimed and finished by another); one that is only ready once ``patience_hops``
    more entries went by without it holding any (a verifier scores in a flash: it is seldom
    caught holding). Kills follow the run's progress, never a clock: a run that slows down
    (a loaded machine, a process loading its model) is killed less often in time, so the
    kills never outpace what restarted processes can take over, and a run makes the same
    number of kills on any machine. Runs until cancelled; a killed process is started again
    by its :meth:`ActorProcess.serve` loop."""
    names = pipeline.scenario.names
    turns: list[str] = []
    while True:
        target = await published(client, names) + rng.randint(*every_hops)
        while await published(client, names) < target:
            await trio.sleep(poll_s)  # the next hop: the poll interval, not a wait for time
        if not turns:
            turns = list(ROLES)
            rng.shuffle(turns)
        role = turns.pop()
        victim = await _victim(pipeline, client, rng, role, target + patience_hops, poll_s)
        if victim is None:  # none of it ready (restarting): its turn comes again later
            turns.insert(0, role)
            continue
        hops = await published(client, names)
        await victim.kill()
        log.kills.append((hops, victim.name))


async def _victim(pipeline: Pipeline, client: RedisClient, rng: random.Random, role: str,
                  patience_until: int, poll_s: float) -> ActorProcess | None:
    """A ready process of ``role`` caught mid-work, or (once ``patience_until`` entries were
    published) any ready one; None when by then none is ready."""
    names = pipeline.scenario.names
    replicas = pipeline.by_role(role)
    while True:
        ready = [a for a in replicas if a.ready_for() > 0]
        busy = ready
        if role in CONSUMES:
            held = await holding(client, names, role)
            busy = [a for a in ready if _mid_work(a, held, len(replicas))]
        if busy:
            return rng.choice(busy)
        if await published(client, names) >= patience_until:
            return rng.choice(ready) if ready else None
        await trio.sleep(poll_s)


# --------------------------------------------------------------------------- poison


def poison_payloads(rng: random.Random, stream: str) -> list[tuple[str, dict[bytes, bytes]]]:
    """Three malformed entries for ``stream``: (kind, fields)."""
    garbage = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 200)))
    if stream == N.TRAJECTORIES:  # a message of the wrong type for each stream
        wrong: msgspec.Struct = WeightsPublished(
            id="poison", created_at=0.0, policy_version=0, version=1, path="/nowhere"
        )
    else:
        wrong = StepMetrics(
            id="poison", created_at=0.0, policy_version=0, step=1, loss=0.0, grad_norm=0.0,
            reward_mean=0.0, groups=1, samples=1, tokens=1, dropped_stale=0,
            max_staleness_seen=0, step_seconds=0.0, wait_seconds=0.0,
        )  # fmt: skip
    return [
        ("garbage", {b"d": b"\xc1" + garbage}),  # 0xc1 is never valid MessagePack
        ("wrong type", {b"d": encode(wrong)}),
        ("no payload field", {b"x": garbage}),
    ]


async def plant_poison(
    client: RedisClient, names: N.Names, rng: random.Random
) -> list[tuple[str, str]]:
    """XADD malformed entries into every pipeline stream (of every shard); returns their
    (stream, entry id), the id qualified by the shard on a sharded run."""
    planted = []
    for layout in names.layouts():
        for stream in PIPELINE_STREAMS:
            for _, fields in poison_payloads(rng, stream):
                entry_id = await client.call(client.sync.xadd, layout.stream(stream), fields)
                planted.append((stream, _qualified(layout, entry_id.decode())))
    return planted


def _qualified(layout: N.Names, entry_id: str) -> str:
    """An entry id as a sharded run shows it (``<shard>:<id>``); unchanged with one shard."""
    return entry_id if layout.shard is None else qualify(layout.shard, entry_id)


# --------------------------------------------------------------------------- recording


@dataclass
class Recorder:
    """Reads the task and trajectory streams as they grow (trimming deletes acknowledged
    entries later): every task admitted and every trajectory published, by entry id."""

    client: RedisClient
    names: N.Names
    tasks: dict[str, Task] = field(default_factory=dict)
    trajectories: dict[str, Trajectory] = field(default_factory=dict)
    evals: dict[str, Trajectory] = field(default_factory=dict)
    ignore: set[tuple[str, str]] = field(default_factory=set)
    """(stream, entry id) the test wrote itself (bad inputs that decode): not pipeline work.
    Entry ids are unique per stream only: two streams often hold the same id."""
    _last: dict[str, str] = field(default_factory=dict)

    async def poll(self) -> None:
        for stream, kind, into in (
            (N.TASKS, Task, self.tasks),
            (N.TRAJECTORIES, Trajectory, self.trajectories),
            (N.EVALS, Trajectory, self.evals),
        ):
            for layout in self.names.layouts():
                key = layout.stream(stream)
                while True:
                    start = f"({self._last[key]}" if key in self._last else "-"
                    rows = await self.client.call(
                        self.client.sync.xrange, key, min=start, max="+", count=1000
                    )
                    for entry_id, fields in rows:
                        eid = entry_id.decode()
                        self._last[key] = eid
                        with contextlib.suppress(MessageError):  # poison: see the dead letters
                            into[_qualified(layout, eid)] = decode(fields.get(b"d", b""), kind)
                    if len(rows) < 1000:
                        break

    async def serve(self, interval_s: float = 0.25) -> None:
        while True:
            await self.poll()
            await trio.sleep(interval_s)

    def _kept(self, stream: str, entries: dict[str, Any]) -> list[Any]:
        return [m for eid, m in entries.items() if (stream, eid) not in self.ignore]

    def train_task_ids(self) -> list[str]:
        return [t.id for t in self._kept(N.TASKS, self.tasks) if t.split == "train"]

    def eval_task_ids(self) -> list[str]:
        return [t.id for t in self._kept(N.TASKS, self.tasks) if t.split == "eval"]

    def trajectory_episodes(self) -> list[str]:
        return [t.episode_id for t in self._kept(N.TRAJECTORIES, self.trajectories)]

    def eval_episodes(self) -> list[str]:
        return [t.episode_id for t in self._kept(N.EVALS, self.evals)]


# --------------------------------------------------------------------------- progress


@dataclass(frozen=True)
class LedgerView:
    """The learner's ``weights/consumed.jsonl``: only lines of versions whose weights exist
    (the others are void, see learner.checkpoint) count."""

    lines: list[dict[str, Any]]
    latest: int

    @classmethod
    def read(cls, root: Path) -> LedgerView:
        latest = latest_version(root) or 0
        lines = []
        path = root / "consumed.jsonl"
        if path.exists():
            for raw in path.read_text().splitlines():
                try:
                    lines.append(json.loads(raw))
                except ValueError:
                    continue  # a torn last line
        return cls([x for x in lines if int(x["version"]) <= latest], latest)

    @property
    def episode_ids(self) -> list[str]:
        return [e for x in self.lines for e in x["episode_ids"]]


async def wait_finished(
    client: RedisClient, scenario: Scenario, *, timeout_s: float, poll_s: float = 1.0
) -> None:
    """Until every admitted group is trained and every work group is idle (lag and pending
    0 on the pipeline streams), all admitted; raises ``trio.TooSlowError`` on timeout."""
    names = scenario.names
    with trio.fail_after(timeout_s):
        while True:
            admitted = int(await client.call(client.sync.get, names.admitted) or 0)
            trained = len(LedgerView.read(scenario.weights_root).episode_ids)
            if admitted == scenario.items and trained >= scenario.items:
                states = [
                    await group_state(client, names, s, N.GROUP_OF_STREAM[s])
                    for s in PIPELINE_STREAMS
                ]
                if all(s.backlog == 0 for s in states):
                    return
            await trio.sleep(poll_s)


async def progress(client: RedisClient, scenario: Scenario) -> str:
    names = scenario.names
    admitted = int(await client.call(client.sync.get, names.admitted) or 0)
    trained = len(LedgerView.read(scenario.weights_root).episode_ids)
    parts = []
    for s in PIPELINE_STREAMS:
        st = await group_state(client, names, s, N.GROUP_OF_STREAM[s])
        parts.append(f"{s}={st.lag}+{st.pending}")
    dead = await stream_length(client, names, N.DEAD)
    return f"admitted {admitted} trained {trained} dead {dead} | " + " ".join(parts)


# --------------------------------------------------------------------------- inspection


@dataclass
class RunReport:
    admitted: int
    train_task_ids: list[str]
    eval_task_ids: list[str]
    trajectory_episodes: list[str]
    eval_episodes: list[str]
    ledger: LedgerView
    metrics: list[StepMetrics]
    pending: dict[str, int]
    """XPENDING summary count of every group of every work stream that has one."""
    dead: list[DeadLetter]
    counters: dict[str, int]
    dead_ids: list[str] = field(default_factory=list)
    """The original entry id of each dead letter, qualified by its shard on a sharded run."""
    admissions_left: int = 0
    """Sharded admissions counted but not finished (queues.shards.finish_counted)."""

    def keyed_dead(self) -> list[tuple[tuple[str, str], DeadLetter]]:
        """Each dead letter with its key: (stream, original entry id, shard-qualified)."""
        ids = self.dead_ids or [d.entry_id for d in self.dead]
        return [((d.stream, i), d) for d, i in zip(self.dead, ids, strict=True)]

    @property
    def dead_keys(self) -> Counter[tuple[str, str]]:
        return Counter(key for key, _ in self.keyed_dead())


async def inspect_run(client: RedisClient, scenario: Scenario, recorder: Recorder) -> RunReport:
    names = scenario.names
    await recorder.poll()

    async def entries(stream: str) -> list[bytes]:
        rows = await client.call(client.sync.xrange, names.stream(stream))
        return [f[b"d"] for _, f in rows]

    pending: dict[str, int] = {}
    dead: list[tuple[str, DeadLetter]] = []
    for layout in names.layouts():
        shard = "" if layout.shard is None else f"@{layout.shard}"
        for stream in N.WORK_STREAMS:
            key = layout.stream(stream)
            if not await client.call(client.sync.exists, key):
                continue
            for g in await client.call(client.sync.xinfo_groups, key):
                group = g["name"].decode() if isinstance(g["name"], bytes) else g["name"]
                summary = await client.call(client.sync.xpending, key, group)
                pending[f"{stream}/{group}{shard}"] = int(summary["pending"])
        rows = await client.call(client.sync.xrange, layout.stream(N.DEAD))
        for _, fields in rows:
            letter = decode(fields[b"d"], DeadLetter)
            dead.append((_qualified(layout, letter.entry_id), letter))
    counters = {}
    for name in ("dropped_stale", "duplicates_skipped"):
        counters[name] = sum(  # one key per shard (in the slot of the shard's hand-offs)
            [int(await client.call(client.sync.get, key) or 0) for key in names.counter_keys(name)]
        )
    return RunReport(
        admitted=int(await client.call(client.sync.get, names.admitted) or 0),
        train_task_ids=recorder.train_task_ids(),
        eval_task_ids=recorder.eval_task_ids(),
        trajectory_episodes=recorder.trajectory_episodes(),
        eval_episodes=recorder.eval_episodes(),
        ledger=LedgerView.read(scenario.weights_root),
        metrics=[decode(x, StepMetrics) for x in await entries(N.METRICS)],
        pending=pending,
        dead=[letter for _, letter in dead],
        counters=counters,
        dead_ids=[entry_id for entry_id, _ in dead],
        admissions_left=int(await client.call(client.sync.hlen, names.admissions)),
    )


def duplicates(items: list[str]) -> list[str]:
    return sorted(k for k, n in Counter(items).items() if n > 1)


def assert_same(what: str, got: list[str], admitted: list[str]) -> None:
    missing, extra = set(admitted) - set(got), set(got) - set(admitted)
    assert not missing and not extra, (
        f"{what}: {len(missing)} of {len(set(admitted))} admitted groups missing "
        f"(e.g. {sorted(missing)[:3]}), {len(extra)} never admitted (e.g. {sorted(extra)[:3]})"
    )


def check_run(
    scenario: Scenario,
    pipeline: Pipeline,
    report: RunReport,
    planted: list[tuple[str, str]],
) -> None:
    """The end state of a run that must have lost nothing and done nothing twice."""
    # No actor died of anything but our SIGKILLs, and every one stopped cleanly at the end
    assert pipeline.crashes() == {}, pipeline.logs()
    stopped = {a.name: a.stop_code for a in pipeline.actors if a.stop_code != 0}
    assert stopped == {}, f"exit codes of the graceful stop: {stopped}\n" + "\n".join(
        f"===== {a.name}\n{a.log_tail()}" for a in pipeline.actors if a.name in stopped
    )

    # Exactly the configured number of training groups was admitted (and, sharded, every
    # counted admission was published)
    assert report.admissions_left == 0
    train = report.train_task_ids
    counts = (report.admitted, scenario.items, len(train), len(set(train)))
    assert len(set(counts)) == 1, f"admitted, limit, recorded, distinct: {counts}"

    # Every group reached the end once: one trajectory each, trained once (ledger)
    assert duplicates(report.trajectory_episodes) == []
    assert_same("trajectories", report.trajectory_episodes, train)
    ledger = report.ledger.episode_ids
    assert duplicates(ledger) == [], "an episode was trained twice"
    assert_same("trained (ledger)", ledger, train)
    assert sum(m.samples for m in report.metrics) == scenario.items * scenario.group_size
    assert report.counters["dropped_stale"] == 0

    # The held-out round at start went through too (no monitor: the evals stream has no group)
    assert sorted(report.eval_episodes) == sorted(report.eval_task_ids)
    assert len(report.eval_task_ids) > 0

    # Nothing pending in any group
    assert {k: v for k, v in report.pending.items() if v} == {}

    # Dead letters: exactly the planted entries, each once, each with its reason
    assert report.dead_keys == {p: 1 for p in planted}
    assert all(d.error for d in report.dead)
