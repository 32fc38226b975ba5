"""``streamrl up``: the whole pipeline on one machine, every actor its own process.

Starts an embedded Redis-compatible server when no Redis URL is configured (loopback only,
random password, AOF), prepares the base model once, then runs scheduler, generator(s),
executor(s), verifier(s) and the learner as child processes that talk only through Redis
Streams. Each child loads the merged config from ``<run dir>/config.json`` (``--config``; its
Redis URL and password come in its environment). A child that dies is restarted after a
backoff (its unacknowledged work is redelivered); one that exits 0 has finished its work (the
learner at ``learner.max_steps``) and is not. The terminal shows one progress line every few
seconds; every actor logs JSON to ``<run dir>/logs/<actor>-<n>.log``.

With ``up.serve_models = N`` it also starts N ``streamrl serve-model`` processes on loopback
ports (before any actor, once each answers ``/health``) and points every generator at them
(``generator.engine = "sglang"``): generation over the SGLang protocol, as on GPUs.

With ``--max-minutes`` the run winds down by itself: admission stops, the learner stops,
and a final held-out evaluation runs on the last policy version before everything is shut
down. Ctrl-C (or SIGTERM) shuts down at once, without the final evaluation.

The embedded server is kept up like a child: when it exits it is started again on its own
data, with the same port and password (the actors ride it out on their reconnect policy).
However ``up`` ends (its limit, a signal, a crash loop, an error of its own) it prints the
summary, writes it to ``--summary-json``, and says how to look at the run afterwards.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import ExitStack, asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
import trio

from streamrl.actors.executor import isolation_report
from streamrl.actors.monitor import Monitor, Summary
from streamrl.actors.scheduler import eval_round_size, publish_eval_round
from streamrl.backoff import Backoff, Retrying
from streamrl.cli.rounds import EvalResult, Rounds, StageRun, rounds_text
from streamrl.config.schema import Config, to_dict
from streamrl.domains.declared import DeclarationError, check_declared
from streamrl.net import free_port, free_ports, wait_healthy
from streamrl.protocol.names import Names
from streamrl.queues.acl import Credentials
from streamrl.queues.client import RedisClient, RedisURL
from streamrl.queues.operations import clear_flag, increment, set_flag
from streamrl.queues.server import (
    LOAD_TIMEOUT_S,
    DataDirBusy,
    ServerProcess,
    find_server_binary,
    hold_data_dir,
)
from streamrl.queues.stats import group_state
from streamrl.runtime.auth import (
    apply_role_users,
    child_environment,
    credentials_for_up,
    serve_role_users,
)
from streamrl.runtime.context import open_context
from streamrl.runtime.lifeline import Lifeline, open_lifeline
from streamrl.runtime.logs import configure_logging, get_logger
from streamrl.runtime.priority import lower_priority, niced
from streamrl.sandbox.base import IsolationTooWeak

log = get_logger()


CRASH_LOOP_EXITS = 5
CRASH_LOOP_S = 60.0
"""A child that exits this many times in a row, each within this many seconds of starting,
is not started again and ``streamrl up`` ends with an error (a bad checkpoint, config or
environment), rather than restarting it for the rest of the run (the defaults of
``up.crash_loop_exits`` and ``up.crash_loop_s``)."""


@dataclass(frozen=True)
class CrashLoop:
    """When restarting a child stops: ``exits`` in a row, each within ``within_s`` of its
    start (``up.crash_loop_exits``, ``up.crash_loop_s``)."""

    exits: int = CRASH_LOOP_EXITS
    within_s: float = CRASH_LOOP_S

    @classmethod
    def of(cls, config: Config) -> CrashLoop:
        return cls(config.up.crash_loop_exits, config.up.crash_loop_s)

RESTART_BACKOFF = Backoff(first_s=1.0, max_s=30.0)
"""The wait before restarting a child that died (the n-th exit in a row within
``CRASH_LOOP_S`` of starting: up to ``min(30, 2 ** (n - 1))`` s, full jitter)."""


@dataclass
class Child:
    actor: str
    index: int
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    process: trio.Process | None = None
    restarts: int = 0
    stopping: bool = False
    health_url: str = ""  # started only once this answers 200 (serve-model)
    gave_up: str = ""
    """Why this child is no longer restarted (a crash loop); empty while it is kept up."""
    pass_fds: tuple[int, ...] = ()  # the lifeline's read end (runtime/lifeline.py)
    backoff: Backoff = RESTART_BACKOFF
    crash_loop: CrashLoop = CrashLoop()
    nice: int = 0
    """Its nice value (``up.decode_nice`` for the decoding processes): its own and its
    session's (runtime/priority.py)."""
    finished: bool = False
    """It exited 0: its work is done (the learner at ``learner.max_steps``), not restarted."""

    @property
    def name(self) -> str:
        return f"{self.actor}-{self.index}"

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep the process running (restart after a backoff when it dies) until stopped,
        until it exits 0 (``finished``: done with its work), or until it has died
        ``crash_loop.exits`` times in a row soon after starting (``gave_up``)."""
        started = False
        restarts = Retrying(self.backoff)  # its failures: exits in a row, each soon after start
        while not self.stopping:
            with self.log_path.open("ab") as logf:
                self.process = await trio.lowlevel.open_process(
                    niced(self.argv, self.nice),
                    env=self.env,
                    stdout=logf,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                    pass_fds=self.pass_fds,
                )
                lower_priority(self.process.pid, self.nice)  # its session's share of the CPUs
            if not started:
                started = True
                if self.health_url:
                    await wait_healthy(self.health_url, 600.0, alive=self._running)
                task_status.started()
            born = time.monotonic()
            code = await self.process.wait()
            if self.stopping:
                return
            if code == 0:  # it ended by itself: its work is done
                self.finished = True
                log.info("actor finished", actor=self.name, log=str(self.log_path))
                return
            if time.monotonic() - born >= self.crash_loop.within_s:
                restarts.reset()  # it ran: a new failure, not a crash loop
            delay = restarts.failed()
            if restarts.failures >= self.crash_loop.exits:  # it cannot start: restarting won't help
                self.gave_up = (
                    f"{self.name} exited {restarts.failures} times in a row within "
                    f"{self.crash_loop.within_s:.0f} s of starting (last exit code {code}); "
                    f"its log: {self.log_path}"
                )
                log.error("actor crash loop, not restarted", actor=self.name, code=code,
                          log=str(self.log_path))
                return
            self.restarts += 1
            log.warning(
                "actor exited, restarting",
                actor=self.name,
                code=code,
                restarts=self.restarts,
                delay_s=round(delay, 2),
                log=str(self.log_path),
            )
            await trio.sleep(delay)

    def _running(self) -> bool:
        return self.process is not None and self.process.returncode is None

    async def stop(self, timeout_s: float = 20.0) -> None:
        self.stopping = True
        proc = self.process
        if proc is None or proc.returncode is not None:
            return
        proc.send_signal(signal.SIGINT)
        with trio.move_on_after(timeout_s):
            await proc.wait()
            return
        proc.kill()
        await proc.wait()

    def kill(self) -> None:
        self.stopping = True
        if self.process is not None and self.process.returncode is None:
            self.process.kill()


def _on_lifeline(children: list[Child], lifeline: Lifeline) -> list[Child]:
    """Every child dies with this process, however it ends (runtime/lifeline.py)."""
    for child in children:
        child.env.update(lifeline.environment())
        child.pass_fds = (lifeline.read_fd,)
    return children


def _serve_models(config: Config) -> tuple[Config, list[Child]]:
    """The inference servers ``up`` starts (``up.serve_models``: serve-model processes, or
    vLLM servers with ``generator.engine = "vllm"``, at least one when that engine has no
    URLs: one per generator), and the config pointing generators at them."""
    vllm = config.generator.engine == "vllm"
    n = config.up.serve_models
    if vllm and not n and not (config.generator.server_urls or config.generator.router_url):
        n = config.up.generators  # one server per generator: the in-process engines' share
    if not n:
        return config, []
    run_dir = config.run.path
    ports = [free_port() for _ in range(n)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    name = "serve-vllm" if vllm else "serve-model"
    env = child_environment(config, os.environ, name, "", {})
    env["OMP_NUM_THREADS"] = str(config.generator.threads or os.cpu_count() or 1)
    g = config.generator

    def argv(port: int) -> list[str]:
        common = [sys.executable, "-m", "streamrl", name, "--model", config.model.spec,
                  "--host", "127.0.0.1", "--port", str(port), "--threads", str(g.threads),
                  "--dtype", g.dtype]
        if vllm:
            return [*common, "--kv-cache-gib", str(config.up.vllm_kv_cache_gib),
                    *(["--enforce-eager"] if config.up.vllm_enforce_eager else [])]
        return [*common, "--max-batch", str(g.max_batch)]

    servers = [
        Child(name, i, argv(port), env, run_dir / "logs" / f"{name}-{i}.log",
              health_url=url + "/health", nice=config.up.decode_nice,
              crash_loop=CrashLoop.of(config))
        for i, (port, url) in enumerate(zip(ports, urls, strict=True))
    ]
    generator = msgspec.structs.replace(config.generator, engine="vllm" if vllm else "sglang",
                                        server_urls=urls)
    return msgspec.structs.replace(config, generator=generator), servers


def write_child_config(config: Config) -> Path:
    """``<run dir>/config.json``: the merged config every child loads (``--config``), written
    atomically. Without the Redis URL: each child has its own in its environment."""
    data = to_dict(config)
    data["run"]["redis_url"] = ""
    path = config.run.path / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def _archiving(config: Config) -> bool:
    """Whether ``up`` starts the archiver: wanted and pyarrow installed."""
    import importlib.util

    return config.ops.archive and bool(importlib.util.find_spec("pyarrow"))


def _children(
    config: Config, config_file: Path, credentials: Mapping[str, Credentials]
) -> list[Child]:
    """One child per actor process, started with ``--config config_file``: Redis URL and its
    own role's password in its environment (never on its command line)."""
    run_dir = config.run.path
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    counts = {
        "scheduler": 1,
        "generator": config.up.generators,
        "executor": config.up.executors,
        "verifier": config.up.verifiers,
        "learner": 1,
        # keeps every trajectory on disk (actors/archiver.py)
        "archiver": 1 if _archiving(config) else 0,
    }
    children = [_child(config, config_file, credentials, actor, i)
                for actor, n in counts.items() for i in range(n)]
    _give_metrics_ports(config, children)
    return children


def _child(config: Config, config_file: Path, credentials: Mapping[str, Credentials],
           actor: str, index: int) -> Child:
    argv = [sys.executable, "-m", "streamrl", "run", actor, "--config", str(config_file)]
    log_path = config.run.path / "logs" / f"{actor}-{index}.log"
    env = child_environment(config, os.environ, actor, config.run.redis_url, credentials)
    decodes = actor == "generator" and config.generator.engine == "transformers"
    return Child(actor, index, argv, env, log_path, crash_loop=CrashLoop.of(config),
                 nice=config.up.decode_nice if decodes else 0)


async def _serve_autoscaler(config: Config, ctx: Any, children: list[Child], config_file: Path,
                            credentials: Mapping[str, Credentials], lifeline: Lifeline,
                            nursery: trio.Nursery, *,
                            task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                            ) -> None:
    """``up.autoscale``: replicas of each stage from its backlog (cli/autoscale.py); added
    replicas are children like the others (restarted, stopped at the end), logged to
    ``<actor>-<index>.log``, without a metrics port of their own."""
    from streamrl.cli.autoscale import STAGE_INPUTS, Autoscaler

    async def sample() -> dict[str, tuple[int, int]]:
        out = {}
        for stream, stage in STAGE_INPUTS:
            state = await group_state(ctx.client, ctx.names, stream, stage)
            out[stream] = (state.lag, state.pending)
        return out

    def live(stage: str) -> list[Child]:
        return [c for c in children if c.actor == stage and not c.stopping and not c.finished]

    async def add(stage: str) -> None:
        index = max((c.index for c in children if c.actor == stage), default=-1) + 1
        child = _child(config, config_file, credentials, stage, index)
        _on_lifeline([child], lifeline)
        children.append(child)
        await nursery.start(child.serve)

    async def remove(stage: str) -> None:
        running = live(stage)
        if not running:  # gone already (it finished, or is stopping with the run's end)
            return
        newest = max(running, key=lambda c: c.index)
        nursery.start_soon(partial(newest.stop, timeout_s=70.0))  # drains what it holds

    replicas = {stage: len(live(stage)) for _, stage in STAGE_INPUTS}
    scaler = Autoscaler(config, sample, add, remove, replicas,
                        lambda: sum(1 for c in children if not c.stopping and not c.finished))
    await scaler.serve(task_status=task_status)


def _give_metrics_ports(config: Config, children: list[Child]) -> None:
    """``ops.metrics_port`` set: a port of its own for each actor process (the i-th gets the
    port + i; -1: the first ports free now from 9400 up), the same across its restarts."""
    base = config.ops.metrics_port
    if not base:
        return
    n = len(children)
    try:
        ports = free_ports(config.ops.metrics_addr, n) if base < 0 else list(range(base, base + n))
    except OSError as exc:
        raise SystemExit(f"streamrl: metrics ports: {exc}") from None
    if ports[-1] > 65535:
        raise SystemExit(f"streamrl: ops.metrics_port {base} + {n} actors > 65535")
    for child, port in zip(children, ports, strict=True):
        child.argv += ["--metrics-port", str(port)]
    listing = ", ".join(f"{c.name} {p}" for c, p in zip(children, ports, strict=True))
    print(f"streamrl: metrics at http://{config.ops.metrics_addr}:PORT/metrics: {listing}",
          flush=True)


async def _prepare(config: Config, fresh: bool) -> None:
    """Before anything is started: ``--fresh`` removes the run's directory; every declared
    domain builds, the executors' isolation is known, the base model is ready."""
    from streamrl.models import UnknownModelSpec, check_model_spec, resolve_model

    try:  # a mistyped model spec: one line, before anything is removed or started
        check_model_spec(config.model.spec)
    except UnknownModelSpec as exc:
        raise SystemExit(f"streamrl: {exc}") from None
    run_dir = config.run.path
    if fresh:
        if config.run.redis_url:
            raise SystemExit(
                "streamrl up --fresh deletes the run's directory with its embedded Redis data; "
                "with an external Redis (run.redis_url) use a new run.name instead"
            )
        if run_dir.exists():
            try:  # not from under a server over its data (another up's, an operator's)
                with hold_data_dir(run_dir / "redis"):
                    shutil.rmtree(run_dir)
            except DataDirBusy as exc:
                raise SystemExit(f"streamrl up --fresh: {exc}; {run_dir} is left as it "
                                 "is") from None
            print(f"streamrl: --fresh: removed {run_dir}", flush=True)
    print(f"streamrl: run {config.run.name!r} in {run_dir}", flush=True)
    try:  # every declared domain builds and loads both splits, before anything is started
        sched = config.scheduler
        eval_only = [d for d in sched.eval_domains if d not in sched.domains]
        notes = await trio.to_thread.run_sync(check_declared, config.domain, eval_only)
    except DeclarationError as exc:
        raise SystemExit(f"streamrl: {exc}") from None
    for note in notes:  # e.g. items a generator failed on: skipped in the run
        print(f"streamrl: note: {note}", flush=True)
    try:  # which isolation the executors will get, before anything is started
        for line in await isolation_report(config):
            print(f"streamrl: {line}", flush=True)
    except IsolationTooWeak as exc:
        raise SystemExit(f"streamrl: {exc}") from None
    if config.queues.shards > 1:
        print(f"streamrl: work streams split into {config.queues.shards} shards", flush=True)
    print(f"streamrl: preparing model {config.model.spec!r} ...", flush=True)
    await trio.to_thread.run_sync(resolve_model, config.model.spec)


@asynccontextmanager
async def _open_redis(config: Config) -> AsyncIterator[str]:
    """The run's Redis URL for the block: ``run.redis_url`` as given, else the embedded
    server's (loopback, random password, AOF in ``<run dir>/redis``), kept up for the block
    (:func:`_serve_embedded`) and stopped after it."""
    if config.run.redis_url:
        yield config.run.redis_url
        return
    binary = find_server_binary(config.run.redis_server)
    server = ServerProcess(data_dir=config.run.path / "redis", binary=binary,
                           allocator=config.run.redis_allocator)
    with ExitStack() as held:
        try:  # no second server over the run's data (an operator command's, another up's)
            held.enter_context(hold_data_dir(server.data_dir))
        except DataDirBusy as exc:
            raise SystemExit(f"streamrl up: {exc}; start it again once that has ended") from None
        try:
            server.start()
            allocator = f", {server.preloaded} preloaded" if server.preloaded else ""
            print(f"streamrl: embedded Redis ({binary}{allocator}) on 127.0.0.1:{server.port} "
                  "(AOF, password)", flush=True)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_serve_embedded, server, RESTART_BACKOFF,
                                   CrashLoop.of(config))
                yield server.url
                nursery.cancel_scope.cancel()
        finally:
            server.stop()


async def _serve_embedded(server: ServerProcess, backoff: Backoff = RESTART_BACKOFF,
                          crash_loop: CrashLoop = CrashLoop()) -> None:
    """Whenever the embedded server exits (killed, crashed), start it again on its own data
    with the same port and password, after the children's backoff: the actors ride it out on
    their reconnect policy, and what the AOF holds (all but about the last second of writes)
    is kept. A server that exits ``crash_loop.exits`` times in a row, each within
    ``crash_loop.within_s`` of starting, ends the run (SystemExit naming its log)."""
    restarts = Retrying(backoff)
    while True:
        process = server.process
        assert process is not None
        born = time.monotonic()
        code = await trio.to_thread.run_sync(process.wait, abandon_on_cancel=True)
        if time.monotonic() - born >= crash_loop.within_s:
            restarts.reset()  # it ran: a new failure, not a crash loop
        delay = restarts.failed()
        log_file = server.data_dir / "server.log"
        if restarts.failures >= crash_loop.exits:
            raise SystemExit(f"streamrl up: the embedded Redis exited {restarts.failures} "
                             f"times in a row within {crash_loop.within_s:.0f} s of starting (last "
                             f"exit code {code}); its log: {log_file}")
        log.warning("embedded redis exited, restarting", code=code, log=str(log_file))
        print(f"streamrl: embedded Redis exited (code {code}); restarting it on its data in "
              f"{server.data_dir}", flush=True)
        await trio.sleep(delay)
        try:
            await trio.to_thread.run_sync(partial(server.start, timeout_s=LOAD_TIMEOUT_S))
        except (RuntimeError, OSError) as exc:  # it died starting or could not be started
            # (a full disk, its binary gone; TimeoutError too): one more exit
            log.warning("embedded redis did not start", error=str(exc)[-500:])
            continue
        print(f"streamrl: embedded Redis is back on 127.0.0.1:{server.port}", flush=True)


@dataclass
class _Ending:
    """How the supervision ended: interrupted by a signal, or children that cannot run."""

    interrupted: bool = False
    failed: list[str] = field(default_factory=list)


async def _up(config: Config, max_minutes: float, fresh: bool = False,
              summary_json: Path | None = None) -> Summary:
    await _prepare(config, fresh)
    deadline = time.monotonic() + max_minutes * 60 if max_minutes else math.inf
    external = bool(config.run.redis_url)
    async with _open_redis(config) as admin_url:
        url = admin_url
        credentials: dict[str, Credentials] = {}
        if config.auth.enabled:  # the actors get their role's user; the admin URL stays here
            credentials = credentials_for_up(config)
            await apply_role_users(config, url, credentials)
            url = RedisURL(url).without_credentials().url
            print("streamrl: one Redis ACL user per actor role", flush=True)
        await _reopen_if_stopped(config, admin_url)
        pipeline = _Pipeline(url, admin_url, credentials, deadline, summary_json, external)
        if config.rounds.stage:
            return await _up_rounds(config, pipeline)
        summary, _ = await pipeline.run(config)
        return summary


@dataclass
class _Pipeline:
    """How ``up`` runs the pipeline once (a plain run, or one stage of a sequence)."""

    url: str
    admin_url: str
    credentials: dict[str, Credentials]
    deadline: float
    summary_json: Path | None
    external: bool

    async def run(self, config: Config, stage: Any = None) -> tuple[Summary, _Ending]:
        """Every child started with ``config``, supervised until the run (or ``stage``: a
        :class:`cli.rounds.StageRun`) ends; the summary printed and written."""
        credentials = self.credentials
        config = msgspec.structs.replace(
            config, run=msgspec.structs.replace(config.run, redis_url=self.url)
        )
        config, servers = _serve_models(config)
        config_file = write_child_config(config)
        children = servers + _children(config, config_file, credentials)
        lifeline = open_lifeline()  # closed by the kernel when this process exits
        _on_lifeline(children, lifeline)
        own = credentials.get("monitor")  # this process: progress, evaluation rounds
        async with open_context(config, "monitor", password=own.password if own else None) as ctx:
            monitor = Monitor(ctx, config.run.path, eval_round_size(config))
            ending = _Ending()
            hooks = None if stage is None else _StageHooks(
                stage, partial(_announce, config, credentials))
            deadline = self.deadline if stage is None else min(self.deadline,
                                                              stage.budget_deadline)
            try:
                await _supervise(config, ctx, monitor, children, config_file, credentials,
                                 lifeline, self.admin_url, deadline, ending, hooks)
            finally:
                rounds = stage.rounds if stage is not None else None
                summary = await _end(monitor, config, ending, self.summary_json,
                                     external=self.external, rounds=rounds)
            if ending.failed:
                raise SystemExit("streamrl up: stopped, an actor cannot run:\n  "
                                 + "\n  ".join(ending.failed))
            return summary, ending

    async def summary_only(self, config: Config, rounds: Any) -> Summary:
        """The summary of the run as it stands, no child started (a judged sequence)."""
        from streamrl.protocol.messages import StepMetrics
        from streamrl.protocol.names import METRICS
        from streamrl.queues.streams import EventReader

        config = msgspec.structs.replace(
            config, run=msgspec.structs.replace(config.run, redis_url=self.url))
        own = self.credentials.get("monitor")
        async with open_context(config, "monitor", password=own.password if own else None) as ctx:
            monitor = Monitor(ctx, config.run.path, 0)  # no round to wait for
            reader = EventReader(ctx.client, ctx.names, METRICS, block_ms=100)
            try:
                while batch := await reader.read_events(StepMetrics):
                    monitor.steps.extend(batch)
            finally:
                reader.close()
            return await _end(monitor, config, _Ending(), self.summary_json,
                              external=self.external, rounds=rounds)


async def _up_rounds(config: Config, pipeline: _Pipeline) -> Summary:
    """``[[rounds.stage]]``: each stage not yet judged, in order, on this run (cli/rounds.py);
    ends at an interruption, a stopped stage, or the end of the sequence."""
    from streamrl.cli.rounds import restore
    from streamrl.models import resolve_model

    rounds = Rounds(config, resolve_model(config.model.spec))
    if (pending := rounds.pending_rollback()) is not None:  # a crash mid-rollback: finished
        assert pending.rollback_version is not None  # its evaluation is the next stage's start
        restore(config.run.path / "rounds" / f"start-v{pending.start_version:06d}",
                rounds.weights, pending.rollback_version)
    summary: Summary | None = None
    while not rounds.finished():
        stage = rounds.next_stage(time.monotonic())
        n = len(config.rounds.stage)
        print(f"streamrl: stage {stage.record.name!r} ({stage.index + 1} of {n}) from "
              f"policy v{stage.record.start_version}", flush=True)
        if stage.index:  # the previous stage's end set the stop flag
            await _reopen_if_stopped(config, pipeline.admin_url, quiet=True)
        try:
            summary, ending = await pipeline.run(stage.config, stage)
        finally:
            if not stage.record.outcome:  # a judged stage's time stopped at its verdict
                stage.account()
                rounds.save()
        if ending.interrupted or not stage.record.outcome:
            break  # continued by the next `up`
    if summary is None:  # nothing left to run: the summary of the run as it stands
        print("streamrl: every stage of the sequence is judged", flush=True)
        summary = await pipeline.summary_only(config, rounds)
    return summary


async def _supervise(config: Config, ctx: Any, monitor: Monitor, children: list[Child],
                     config_file: Path, credentials: dict[str, Credentials],
                     lifeline: Lifeline, admin_url: str, deadline: float,
                     ending: _Ending, hooks: _StageHooks | None = None) -> None:
    """Run the monitor and every child until the deadline, ``learner.max_steps``, a crash
    loop or a signal; then the final evaluation (not after a signal or a crash loop) and
    every child stopped. A stage of a sequence (``hooks``) starts the learner and the
    scheduler only after its start is evaluated, and is judged after its final round."""
    training = [c for c in children if hooks is not None and c.actor in _TRAINING]
    async with trio.open_nursery() as nursery:
        if credentials:  # created again if Redis loses them (no ACL file)
            await nursery.start(serve_role_users, config, admin_url, credentials)
        await nursery.start(monitor.serve)
        for child in children:
            if child not in training:
                await nursery.start(child.serve)
        print(f"streamrl: started {len(children)} actors; logs in {config.run.path / 'logs'}",
              flush=True)
        if config.up.autoscale:
            await nursery.start(partial(
                _serve_autoscaler, config, ctx, children, config_file, credentials,
                lifeline, nursery))
            print("streamrl: autoscaling generators, executors and verifiers "
                  f"(up to {config.up.autoscale_max_replicas} each)", flush=True)
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as waiter:

                async def on_signal() -> None:
                    async for _ in signals:
                        ending.interrupted = True
                        print("\nstreamrl: interrupted, shutting down", flush=True)
                        waiter.cancel_scope.cancel()
                        return

                waiter.start_soon(on_signal)
                if hooks is not None:
                    await hooks.stage.before_training(partial(_evaluate, ctx, monitor, config))
                    for child in training:
                        await nursery.start(child.serve)
                await _progress_until(monitor, deadline, config.up.progress_interval_s,
                                      config.learner.max_steps, children)
                ending.failed = [c.gave_up for c in children if c.gave_up]
                if not ending.failed:
                    final = await _final_eval(ctx, children, monitor, config)
                    if hooks is not None:
                        await hooks.stage.after_final_eval(
                            final, partial(_evaluate, ctx, monitor, config), hooks.announce)
                waiter.cancel_scope.cancel()
            with trio.CancelScope(shield=True):
                await _stop_all(children, signals)
        nursery.cancel_scope.cancel()


async def _end(monitor: Monitor, config: Config, ending: _Ending, summary_json: Path | None,
               *, external: bool, rounds: Rounds | None = None) -> Summary:
    """The run's summary however the run ended (an error too): its figures read once more
    where Redis answers, printed, written to ``summary_json``; then how to look at the run."""
    with trio.CancelScope(shield=True), trio.move_on_after(10):
        try:  # the figures as the run ended (not a second stale)
            await monitor.refresh_domains()
        except Exception as exc:  # Redis gone with the run: the figures read last
            log.warning("summary without the last figures", error=repr(exc))
    summary = monitor.summary(config.run.name)
    g = config.generator
    summary.engine = g.engine
    summary.engine_servers = len(g.server_urls) if g.engine != "transformers" else 0
    if rounds is not None:
        summary.rounds = rounds.summary()
    print(_summary_text(summary, ending.interrupted), flush=True)
    if rounds is not None:
        print(rounds_text(summary.rounds, len(rounds.config.rounds.stage)), flush=True)
    if summary_json is not None:
        summary_json.parent.mkdir(parents=True, exist_ok=True)
        summary_json.write_text(json.dumps(msgspec.to_builtins(summary), indent=2) + "\n")
        print(f"streamrl: summary in {summary_json}", flush=True)
    print(_look_text(config.run.path, external=external), flush=True)
    return summary


def _look_text(run_dir: Path, *, external: bool) -> str:
    """How to look at the run once ``up`` has ended (or while it runs): the operator
    commands by the merged config (with the embedded server, they open its data)."""
    merged = run_dir / "config.json"
    where = ("with $STREAMRL_REDIS_URL set to the run's Redis" if external
             else "(they start the run's embedded server over its data)")
    return (
        f"streamrl: look at the run {where}:\n"
        f"  streamrl report --config {merged} --out {run_dir / 'report'}\n"
        f"  streamrl replay show --config {merged} --limit 3\n"
        f"  streamrl status --config {merged}\n"
        f"  streamrl dlq list --config {merged}"
    )


async def _reopen_if_stopped(config: Config, admin_url: str, *, quiet: bool = False) -> None:
    """An earlier ``up`` of this run ended by setting the run's stop flag (no more
    admissions): this ``up`` resumes the run, so it clears the flag and says so. The weights,
    the ledger and the queued work of the run are kept (``--fresh`` starts over)."""
    from streamrl.learner.weights import latest_version

    names = Names(config.run.name, shards=config.queues.shards)
    client = RedisClient(admin_url)
    try:
        if await clear_flag(client, names.stop) and not quiet:
            version = latest_version(config.run.path / "weights") or 0
            print(
                f"streamrl: resuming run {config.run.name!r} at policy v{version} "
                "(`up --fresh` starts it over)",
                flush=True,
            )
    finally:
        client.close()


async def _progress_until(
    monitor: Monitor, deadline: float, interval: float, max_steps: int, children: list[Child]
) -> None:
    """Print progress until the deadline, until the learner has taken ``max_steps``, or
    until a child is in a crash loop."""
    next_print = time.monotonic() + interval
    while time.monotonic() < deadline:
        if max_steps and monitor.steps and monitor.steps[-1].step >= max_steps:
            break
        if any(c.gave_up for c in children):
            break
        await trio.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        if time.monotonic() >= next_print:
            print(monitor.progress_line(), flush=True)
            next_print += interval


async def _final_eval(ctx: Any, children: list[Child], monitor: Monitor,
                      config: Config) -> EvalResult | None:
    """Stop admitting and training, then evaluate the last policy version."""
    await set_flag(ctx.client, ctx.names.stop)
    for child in children:
        if child.actor in _TRAINING:
            await child.stop()
    version = monitor.steps[-1].step if monitor.steps else 0
    return await _evaluate(ctx, monitor, config, version, what="final evaluation")


async def _evaluate(ctx: Any, monitor: Monitor, config: Config, version: int,
                    what: str = "evaluation") -> EvalResult | None:
    """One held-out round of policy ``version`` (the generators serving it), awaited up to 15
    minutes; its mean reward per domain, None if it did not finish."""
    round_no = await increment(ctx.client, ctx.names.eval_round) - 1
    print(f"streamrl: {what} (round {round_no}) of policy v{version} ...", flush=True)
    await publish_eval_round(ctx, round_no, version)
    with trio.move_on_after(900):
        while True:
            with trio.move_on_after(config.up.progress_interval_s):
                done = await monitor.wait_round(round_no)
                return EvalResult(version, done.domain_means())
            print(monitor.progress_line(), flush=True)
    print(f"streamrl: {what} did not finish within 15 minutes", flush=True)
    return None


_TRAINING = ("learner", "scheduler")
"""The children that train (stopped for the final evaluation; a stage starts them last)."""


@dataclass
class _StageHooks:
    """A stage of a sequence under supervision: its judge, and how a version is announced."""

    stage: StageRun
    announce: Callable[[int], Awaitable[None]]


async def _announce(config: Config, credentials: Mapping[str, Credentials], version: int) -> None:
    """Announce weights ``version`` (a rollback's, already on disk) on the weights stream as
    the learner role, the event a learner step publishes: the generators load it like any
    update (the next stage's learner announces it once more at its start: no-op for them)."""
    from streamrl.learner.weights import version_dir
    from streamrl.protocol.messages import WeightsPublished, new_id, now
    from streamrl.protocol.names import WEIGHTS
    from streamrl.queues.codec import encode
    from streamrl.queues.streams import Producer

    own = credentials.get("learner")
    path = str(version_dir(config.run.path / "weights", version))
    event = WeightsPublished(id=new_id(), created_at=now(), policy_version=version,
                             version=version, path=path)
    async with open_context(config, "learner", password=own.password if own else None) as ctx:
        await Producer(ctx.client, ctx.names).publish(WEIGHTS, [encode(event)])


async def _stop_all(children: list[Child], signals: AsyncIterator[int]) -> None:
    """Stop every child (SIGINT, then SIGKILL after its grace period); a signal meanwhile (a
    second Ctrl-C) SIGKILLs them all at once."""

    async def kill_on_signal() -> None:
        async for _ in signals:
            print("streamrl: second signal, killing the actors", flush=True)
            for child in children:
                child.kill()
            return

    async with trio.open_nursery() as nursery:
        nursery.start_soon(kill_on_signal)
        async with trio.open_nursery() as stopping:
            for child in children:
                stopping.start_soon(child.stop)
        nursery.cancel_scope.cancel()


def _without_learning(s: Summary) -> str:
    """The summary line's note of groups that taught nothing: skipped (or, with
    ``learner.step_without_signal``, trained) without learning signal, and unjudged."""
    notes = [f"{n} {what}" for n, what in (
        (s.skipped_no_signal, "groups skipped for no learning signal"),
        (s.published_without_signal, "groups trained without learning signal"),
        (s.unjudged, "groups the verifier could not judge (never trained)"),
    ) if n]  # fmt: skip
    return "".join(f", {note}" for note in notes)


def _summary_text(s: Summary, interrupted: bool) -> str:
    def f(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.3f}"

    return (
        f"\nstreamrl: {'interrupted' if interrupted else 'finished'} after {s.minutes} min: "
        f"{s.steps} steps, policy v{s.policy_version}, {s.trajectories} groups "
        f"({s.samples} samples) trained, {s.dropped_stale} stale dropped, "
        f"{s.dead_letters} dead letters" + _without_learning(s) + "\n"
        f"  held-out eval reward: before {f(s.eval_reward_before)}"
        f"  after {f(s.eval_reward_after)}\n"
        f"  train reward: first steps {f(s.reward_first_steps)}"
        f"  last steps {f(s.reward_last_steps)}"
        + (f"\n  generated by: {s.engine}"
           + (f" ({s.engine_servers} server{'s' if s.engine_servers != 1 else ''})"
              if s.engine_servers else " (in-process)") if s.engine else "")
    )


def run_up(config: Config, *, max_minutes: float = 0.0, fresh: bool = False,
           summary_json: Path | None = None) -> Summary:
    """Run the pipeline until it ends; the summary is printed and written to
    ``summary_json`` however it ends (an error, a crash loop, a signal too)."""
    configure_logging(actor="supervisor", level="warning")
    try:
        return trio.run(_up, config, max_minutes, fresh, summary_json)
    except BaseExceptionGroup as group:  # a task's SystemExit (the server's crash loop): its words
        exits, rest = group.split(SystemExit)
        if exits is None or rest is not None:
            raise
        leaf: BaseException = exits
        while isinstance(leaf, BaseExceptionGroup):
            leaf = leaf.exceptions[0]
        raise leaf from None
