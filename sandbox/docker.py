"""The Docker sandbox backend: hardened containers from a warm pool, each with a resident runner.

Guarantees (on top of :mod:`sandbox.base`):
- every container is created with the whole hardening list: user 65534, ``CapDrop ALL``,
  ``no-new-privileges``, default seccomp, never privileged, no Docker socket, ``NetworkMode
  none``, read-only root, tmpfs /work (nosuid, nodev, size cap) and /tmp (noexec too), a
  private /dev/shm of ``shm_mb``, memory == memory+swap (no swap), ``NanoCpus``, ``PidsLimit``,
  ulimits nofile and fsize, ``Init`` (tini as pid 1), positive OOM score, no log driver;
- each command is started by the container's resident runner (:mod:`sandbox.runner`) with
  fork/exec: no ``docker exec``, no network, files travel through the attached stdin/stdout
  (``put_archive`` is refused on a read-only root);
- time limits: the runner kills the command at ``limits.timeout_s`` (and the CPU rlimit); the
  host removes the whole container if no reply came by ``timeout_s + host_grace_s`` (the
  code can stop or kill its runner, which shares its uid: such a run reports
  ``timed_out``/``exit_code None`` and the container is replaced, never reused);
- a warm pool of ``pool_size`` started containers per image; a container is reset (every
  process killed, /work, /tmp, /dev/shm emptied) before it serves another episode, and
  removed instead if the reset fails or the runner misbehaved;
- nothing outlives its owner: after each command the runner kills every process it started;
  sessions give their container back (reset) on every exit path; ``aclose`` removes every
  container (those it tracks and any the engine lists under its instance label) and returns
  once the engine lists none; a container whose executor died sees EOF on stdin, its runner
  exits and Docker removes it (``AutoRemove``); ``reap_orphans()`` (also run at start)
  removes what is left by executors that died. Containers carry the labels ``streamrl.sandbox``,
  ``streamrl.instance`` and ``streamrl.owner`` (host/pid/start time); a session's container
  is renamed ``streamrl-<label>-<instance>-<n>`` after its label (the message id) before it
  is used, a one-shot ``run``'s container likewise once its command has run
  ``name_runs_after_s`` (concurrently with it: short runs cost no engine call); the pool
  gives it its neutral name back before reusing it.

Fleet controls (agentic RL at scale breaks sandbox fleets in known ways: containers piling
up while they are created, the engine's creation-rate limits, containers leaked by dead
workers):
- at most ``max_containers`` containers live at once, and at most ``max_starting`` of them
  being created (create, start, runner ready) at once; the rest wait their turn;
- at most ``create_rate_per_s`` creates a second (0: unlimited), ``create_burst`` at once
  after a quiet spell (a :class:`TokenBucket` before each create, first come first served);
- a session older than ``session_max_s`` (0: no limit) is refused: each call raises
  :class:`~sandbox.base.SessionExpired` (a command already running finishes), and the next
  sweep removes its container unless a call holds it. It is the backend's safety net for
  sessions whose episode was abandoned; the episode's own wall clock is the domain's
  (``EpisodePolicy.timeout_s``, ended by the executor after a turn);
- every ``sweep_interval_s`` (0: only at start) a sweep reaps what other executors left:
  ``reap_orphans(max_age_s=leak_age_s)``. With ``leak_age_s`` (0: age is no criterion) a
  container of ANY live executor that old would be reaped, so this backend never keeps one
  that long: it reuses a container only until ``leak_age_s / 2`` (then removes it when it
  is idle or given back) and removes any container at ``leak_age_s - 2 * sweep_interval_s``,
  in use or not (the run in it gets a lost result, a session ``SandboxUnavailable``);
  ``leak_age_s`` must be at least ``4 * sweep_interval_s`` (:func:`fleet_problem`);
- :meth:`DockerSandbox.statistics` counts it: ``starting`` and ``running`` containers now,
  the ``max_starting_seen``, ``leaked`` containers found by sweeps and ``reaped`` by them,
  ``expired`` sessions.

What it does NOT isolate: the kernel is shared (default seccomp, no gVisor unless
``runtime="runsc"``); the code runs as the same uid as its runner (it can kill or stop it:
that costs the code its run, it cannot forge a reply, see :mod:`sandbox.runner`); tmpfs pages
count against the container's memory cgroup; ``oom_killed`` relies on the container's memory
cgroup counter being readable inside it.

Structured: a ``DockerSandbox`` is served by its owner, in the owner's nursery
(``async with open_docker_sandbox(...) as box``, or ``await nursery.start(box.serve)`` as the
executor's :class:`actors.executor.Sandboxes` does); ``serve`` holds the trio-asyncio loop,
the engine connection and the pool tasks, and removes every container when it ends (the
``async with`` exits, ``aclose``, or the nursery is cancelled). A backend failure propagates
to its callers: when the engine is unreachable at start, or its connection fails later (a
command's stream breaks and the engine does not answer), the calls in flight are cut short
and they and every later call raise :class:`SandboxUnavailable` chained to the original
exception (``__cause__``); the backend is then ``stopped`` and its owner opens a fresh one.
A call on a sandbox nobody serves is a programming error (``RuntimeError``).

aiodocker is asyncio: it runs through trio-asyncio, in one loop per sandbox, held by
``serve``. This is the only module that uses the bridge. A ``DockerSandbox`` belongs to one
``trio.run``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import secrets
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import structlog
import trio

from streamrl.backoff import Backoff, Retrying
from streamrl.sandbox.base import (
    ExecRequest,
    ExecResult,
    IsolationLevel,
    Limits,
    SandboxUnavailable,
    SessionExpired,
)
from streamrl.sandbox.runner_channel import RunnerChannel, RunnerGone, lost_result

log = structlog.get_logger()

T = TypeVar("T")
DEFAULT_IMAGE = "streamrl-sandbox:offline"
RUNNER_SOURCE = Path(__file__).with_name("runner.py").read_text()
SANDBOX_UID = 65534
RUNNER_MB = 32  # added to the memory limit: the runner and init live in the same cgroup
RUNNER_PIDS = 2  # init and the runner, added to the pids limit
REMOVE_WAIT_S = 20.0  # how long a removal waits for the engine to drop the container
LABEL = "streamrl.sandbox"


@dataclass(frozen=True)
class DockerStatistics:
    created: int
    reused: int
    replaced: int
    removed: int
    reaped: int
    """Containers of other executors removed by a sweep (at start, every sweep_interval_s)."""
    leaked: int
    """Containers of other executors a sweep found left over (reaped, or failed to)."""
    expired: int
    """Sessions refused for their age (session_max_s)."""
    max_starting_seen: int
    """The most containers ever being created at once (never above max_starting)."""
    ready: int
    busy: int
    starting: int
    """Containers being created now (create, start, runner ready)."""
    running: int
    """Live containers now (ready + busy)."""


def fleet_problem(sweep_interval_s: float, leak_age_s: float) -> str | None:
    """Why a sweep with these settings could reap a live executor's container, or None.

    A sweep reaps containers older than ``leak_age_s``, whoever owns them; each backend
    removes its own at ``leak_age_s - 2 * sweep_interval_s`` at the latest (found by its own
    sweep, so up to one interval late) and stops reusing them at half the age, which needs
    ``leak_age_s >= 4 * sweep_interval_s``."""
    if not leak_age_s:
        return None
    if not sweep_interval_s:
        return "leak_age_s needs sweep_interval_s (nothing would retire old containers)"
    if leak_age_s < 4 * sweep_interval_s:
        return (f"leak_age_s ({leak_age_s:g} s) must be at least 4 * sweep_interval_s "
                f"({4 * sweep_interval_s:g} s): a live backend retires its containers "
                f"before they are that old, a sweep interval ahead")
    return None


class TokenBucket:
    """``await take()`` lets ``burst`` callers through at once, then ``rate_per_s`` a second,
    first come first served (0: unlimited, never waits). In any span of ``t`` seconds at
    most ``burst + t * rate_per_s`` get through. Trio's clock, so tests may jump it."""

    def __init__(self, rate_per_s: float, burst: int = 1) -> None:
        if rate_per_s < 0 or burst < 1:
            raise ValueError(f"a token bucket needs rate_per_s >= 0 and burst >= 1, "
                             f"not {rate_per_s} and {burst}")
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._tokens = float(burst)
        self._at: float | None = None  # when _tokens was last brought up to date
        self._lock = trio.Lock()  # fair: waiters get their tokens in the order they came

    async def take(self) -> None:
        if not self.rate_per_s:
            await trio.lowlevel.checkpoint()
            return
        async with self._lock:
            self._refill()
            if self._tokens < 1:
                await trio.sleep((1 - self._tokens) / self.rate_per_s)
                self._refill()
            self._tokens -= 1

    def _refill(self) -> None:
        now = trio.current_time()
        if self._at is not None:
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate_per_s)
        self._at = now


class DockerSandbox:
    """Runs each :class:`ExecRequest` in a warm, hardened container. ``run`` is concurrency-safe.

    ``image`` must contain ``python3`` (see sandbox/images/). ``limits`` sets the container-wide
    ceilings at creation (memory, processes, file size, open files); a request whose memory or
    process limit differs updates its container's cgroup before running.
    ``name_runs_after_s``: a labelled one-shot ``run`` still running after this long has its
    container renamed after the label (0: at once, still concurrently with the command).
    ``max_containers``, ``max_starting``, ``create_rate_per_s``, ``create_burst``,
    ``session_max_s``, ``sweep_interval_s``, ``leak_age_s``: the fleet controls (see the
    module docstring).
    """

    name = "docker"
    isolation: IsolationLevel = "docker"

    def __init__(
        self,
        image: str = DEFAULT_IMAGE,
        *,
        pool_size: int = 2,
        limits: Limits | None = None,
        cpus: float = 1.0,
        work_mb: int = 64,
        tmp_mb: int = 16,
        shm_mb: int = 16,
        max_containers: int = 64,
        host_grace_s: float = 2.0,
        start_timeout_s: float = 30.0,
        docker_url: str | None = None,
        runtime: str | None = None,
        python: str = "python3",
        reap_at_start: bool = True,
        name_runs_after_s: float = 0.2,
        max_starting: int = 8,
        create_rate_per_s: float = 0.0,
        create_burst: int = 4,
        session_max_s: float = 0.0,
        sweep_interval_s: float = 60.0,
        leak_age_s: float = 0.0,
    ) -> None:
        problem = fleet_problem(sweep_interval_s, leak_age_s)
        if problem or max_starting < 1 or min(session_max_s, sweep_interval_s) < 0:
            raise ValueError(problem or "max_starting must be >= 1; session_max_s and "
                             "sweep_interval_s >= 0")
        self.image = image
        self.pool_size = pool_size
        self.limits = limits or Limits()
        self.instance = secrets.token_hex(6)
        self._cpus = cpus
        self._mounts = (work_mb, tmp_mb, shm_mb)
        self._slots = trio.Semaphore(max_containers)
        self._starting_slots = trio.Semaphore(max_starting)
        self._create_rate = TokenBucket(create_rate_per_s, create_burst)
        self._starting = 0
        self._session_max = session_max_s
        self._sweep_interval = sweep_interval_s
        self._leak_age = leak_age_s
        self._sessions: set[DockerSession] = set()
        self._grace = host_grace_s
        self._start_timeout = start_timeout_s
        self._url = docker_url
        self._runtime = runtime
        self._python = python
        self._reap_at_start = reap_at_start
        self._name_after = name_runs_after_s
        self._pools: dict[str, _Pool] = {}
        self._boxes: dict[str, _Box] = {}
        self._seq = itertools.count(1)
        self._counts = dict.fromkeys(("created", "reused", "replaced", "removed", "reaped",
                                      "leaked", "expired", "max_starting_seen"), 0)
        self._started = False
        self._ready = trio.Event()
        self._closing = trio.Event()
        self._stopped = trio.Event()
        self._error: BaseException | None = None  # why it stopped (the engine failed)
        self._calls: set[trio.CancelScope] = set()  # calls in flight, cut short on a failure
        self._loop: Any = None
        self._docker: Any = None
        self._nursery: trio.Nursery | None = None

    # -- public API ---------------------------------------------------------------------

    async def run(self, request: ExecRequest, label: str = "") -> ExecResult:
        """A one-shot run in a warm container. ``label`` (the message id) names the container
        once the command has run ``name_runs_after_s``: the rename goes to the engine
        concurrently with the command, never before it, and a command done sooner (most are)
        costs no engine call at all. The container gets its pool name back before the pool
        hands it out again."""
        with self._call():
            box = await self._acquire(self.image, request.limits, "")
            if label:
                box.rename_soon(self._label_name(label), self._name_after)
            try:
                return await box.run(request)
            finally:
                box.skip_pending_rename()
                self._release(box)

    @asynccontextmanager
    async def session(self, limits: Limits, label: str = "") -> AsyncIterator[DockerSession]:
        session = DockerSession(self, limits, label)
        with self._call():
            await session.open()
        self._sessions.add(session)
        try:
            yield session
        finally:
            self._sessions.discard(session)
            await session.aclose()

    @property
    def stopped(self) -> bool:
        """Its engine connection has ended for good (the engine was unreachable at start, or
        the connection failed later; every call now raises :class:`SandboxUnavailable`
        chained to that failure): the owner replaces it with a fresh instance, served anew,
        which connects again (``actors.executor.Sandboxes``)."""
        return self._error is not None or self._stopped.is_set()

    async def aclose(self) -> None:
        self._closing.set()
        if self._started:
            with trio.CancelScope(shield=True):
                await self._stopped.wait()

    @property
    def detail(self) -> str:
        """How this sandbox isolates, in words (logged when the executor opens it)."""
        return f"hardened containers of {self.image} (runtime {self._runtime or 'default'})"

    def statistics(self) -> DockerStatistics:
        ready = sum(1 for pool in self._pools.values() for box in pool.ready if box.gone is None)
        live = sum(1 for box in self._boxes.values() if box.gone is None)
        return DockerStatistics(**self._counts, ready=ready, busy=live - ready,
                                starting=self._starting, running=live)

    async def reap_orphans(self, max_age_s: float | None = None) -> list[str]:
        """Remove sandbox containers of executors that died: not running, owned by a dead
        process of this host, or (with ``max_age_s``) older than that. Returns their names.
        Counts them as ``leaked`` (and ``reaped`` once removed); one already being removed
        (by Docker's auto-remove or its owner) is no leak."""
        await self._start()
        found = await self._aio(
            self._docker.containers.list(all=True, filters=json.dumps({"label": [LABEL]}))
        )
        removed = []
        for item in found:
            labels = item["Labels"] or {}
            if labels.get("streamrl.instance") == self.instance:
                continue
            too_old = max_age_s is not None and time.time() - item["Created"] > max_age_s
            ended = item["State"] in ("exited", "dead")
            if not (ended or too_old or _owner_dead(labels.get("streamrl.owner"))):
                continue
            name = _container_name(item)
            try:
                await self._aio(item.delete(force=True, v=True))
            except Exception as exc:  # the engine's answer becomes a count and a log line
                if getattr(exc, "status", None) not in (404, 409):  # (gone, being removed)
                    self._counts["leaked"] += 1
                    log.warning("sandbox.orphan_remove_failed", container=name, error=repr(exc))
                continue
            removed.append(name)  # counted at once: a later item's failure loses no count
            self._counts["leaked"] += 1
            self._counts["reaped"] += 1
        if removed:
            log.warning("sandbox.orphans_removed", containers=removed)
        return removed

    # -- the asyncio side, in the owner's nursery ------------------------------------------

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Hold the engine connection, the pool and the containers until :meth:`aclose` (or
        cancellation); started (``nursery.start``) once connected, or once that failed: the
        failure is kept for the callers (:class:`SandboxUnavailable`), never raised into the
        owner's nursery. Removes every container before it returns."""
        import aiodocker
        import trio_asyncio

        if self._started:
            raise RuntimeError("a DockerSandbox is served once")
        self._started = True

        async def connect() -> Any:
            return aiodocker.Docker(url=self._url)

        try:
            async with trio_asyncio.open_loop() as loop:
                self._loop = loop
                try:
                    self._docker = await loop.run_aio_coroutine(connect())
                    await self._aio(self._docker.version())
                except Exception as exc:
                    self._fail(exc)
                    if self._docker is not None:
                        with contextlib.suppress(Exception):
                            await self._aio(self._docker.close())
                    self._ready.set()
                    task_status.started()  # the calls get why, not the owner's nursery
                    return
                try:
                    async with trio.open_nursery() as nursery:
                        self._nursery = nursery
                        self._ready.set()
                        task_status.started()
                        nursery.start_soon(self._serve_sweeps)
                        await self._closing.wait()
                        nursery.cancel_scope.cancel()
                finally:
                    with trio.CancelScope(shield=True), trio.move_on_after(30):
                        await self._remove_all()
                        with contextlib.suppress(Exception):
                            await self._aio(self._docker.close())
        except Exception as exc:  # the loop or a pool task failed: the callers get it
            self._fail(exc)
            if not self._ready.is_set():  # (failed before it was started)
                self._ready.set()
                task_status.started()
        finally:
            self._closing.set()
            self._ready.set()
            self._stopped.set()
            self._cut_calls()

    def _fail(self, exc: BaseException) -> None:
        """The backend failed for good: keep ``exc`` for every caller, cut calls in flight."""
        if self._error is None:
            self._error = exc
            log.error("sandbox.docker_failed", error=repr(exc))
        self._closing.set()
        self._cut_calls()

    def _cut_calls(self) -> None:
        if self._error is not None:
            for scope in self._calls:
                scope.cancel()

    def _unavailable(self) -> SandboxUnavailable:
        """What a call raises once the backend stopped, chained to the failure."""
        error = self._error
        if error is None:
            return SandboxUnavailable("DockerSandbox is closed")
        what = "Docker engine unreachable" if self._nursery is None else "Docker sandbox stopped"
        unavailable = SandboxUnavailable(f"{what}: {error!r}")
        unavailable.__cause__ = error
        return unavailable

    @contextmanager
    def _call(self) -> Iterator[None]:
        """One call in flight: cut short (:class:`SandboxUnavailable`, chained to the
        failure) when the backend fails while it runs."""
        scope = trio.CancelScope()
        self._calls.add(scope)
        try:
            with scope:
                yield
        finally:
            self._calls.discard(scope)
        if scope.cancelled_caught:
            raise self._unavailable()

    async def _start(self) -> None:
        if not self._started:
            raise RuntimeError(
                "this DockerSandbox is not served: open it with `async with "
                "open_docker_sandbox(...)` or `await nursery.start(sandbox.serve)`"
            )
        await self._ready.wait()
        if self._closing.is_set():
            raise self._unavailable()

    async def _engine_failed(self, exc: BaseException) -> bool:
        """After a broken runner stream: whether the engine is gone too (then the backend
        fails with ``exc``). A runner the code killed leaves the engine answering."""
        if self._error is not None:
            return True
        with trio.move_on_after(max(self._grace, 1.0)):
            with contextlib.suppress(Exception):
                await self._aio(self._docker.version())
                return False
        self._fail(exc)
        return True

    async def _delete(self, container: Any, name: str, deadline_s: float = REMOVE_WAIT_S,
                      *, by_name: bool = False) -> bool:
        """Force-remove ``container`` and return once the engine no longer lists it (True), or
        False when it still does after ``deadline_s`` (logged). A delete that succeeds returns
        once the container is gone; a 409 (a removal already under way, most often the
        engine's own ``AutoRemove``: the runner exits when its stdin closes) comes before that
        removal ends, so this then waits until the container is no longer listed. Whether it
        is listed is asked with a list filtered by the sandbox label (by id, or by ``name``
        with ``by_name``): the one query the socket proxy (sandbox/socket_proxy.py) answers
        for a container that is gone (it refuses calls on containers it cannot see labelled,
        gone ones included)."""
        which = {"name": [f"^/{re.escape(name)}$"]} if by_name else {"id": [container.id]}
        query = json.dumps({"label": [LABEL], **which})
        retrying = Retrying(Backoff(0.05, 1.0))
        removing = False  # the engine is removing it (409): wait for that, never ask again
        with trio.move_on_after(deadline_s):
            while True:
                if not removing:
                    try:
                        await self._aio(container.delete(force=True, v=True))
                        return True  # (the engine answers once the container is removed)
                    except SandboxUnavailable:
                        raise
                    except Exception as exc:  # 404: gone; 409: being removed; else: again
                        status = getattr(exc, "status", None)
                        if status == 404:
                            return True
                        removing = status == 409
                        if not removing:
                            log.debug("sandbox.remove_retry", container=name, error=repr(exc))
                try:
                    if not await self._aio(self._docker.containers.list(all=True, filters=query)):
                        return True
                except SandboxUnavailable:
                    raise
                except Exception as exc:  # the engine's answer is lost: ask again
                    log.debug("sandbox.remove_check_failed", container=name, error=repr(exc))
                await retrying.wait()
        log.warning("sandbox.remove_unfinished", container=name, waited_s=deadline_s)
        return False

    async def _aio(self, coro: Awaitable[T]) -> T:
        """Await an asyncio (aiodocker) coroutine from trio, through this sandbox's loop."""
        if self._loop is None:
            raise SandboxUnavailable("Docker sandbox loop is not running")
        return await self._loop.run_aio_coroutine(coro)  # type: ignore[no-any-return]

    async def _serve_sweeps(self) -> None:
        """Reap orphans at start (``reap_at_start``), then sweep every ``sweep_interval_s``:
        expired sessions' containers, this backend's containers past their age, and what
        other executors left (``reap_orphans(leak_age_s)``)."""
        if self._reap_at_start:
            await self._reap_quietly(None)
        if not self._sweep_interval:
            return
        while True:
            await trio.sleep(self._sweep_interval)
            for session in list(self._sessions):
                await session.drop_if_expired()
            await self._retire_old()
            await self._reap_quietly(self._leak_age or None)

    async def _reap_quietly(self, max_age_s: float | None) -> None:
        try:
            await self.reap_orphans(max_age_s)
        except Exception as exc:  # the next sweep tries again
            log.warning("sandbox.reap_failed", error=repr(exc))

    def _worn(self, box: _Box) -> bool:
        """Too old to serve another run (``leak_age_s / 2``): removed instead of reused."""
        return bool(self._leak_age) and trio.current_time() - box.born > self._leak_age / 2

    async def _retire_old(self) -> None:
        """Remove this backend's containers before another's sweep would take them for
        leaks: idle ones past ``leak_age_s / 2``, any past ``leak_age_s - 2 *
        sweep_interval_s`` (in use too: the run in it loses its container)."""
        if not self._leak_age:
            return
        limit = trio.current_time() - (self._leak_age - 2 * self._sweep_interval)
        idle = [box for pool in self._pools.values() for box in pool.ready if self._worn(box)]
        old = [box for box in self._boxes.values() if box.born < limit and box not in idle]
        for box in idle:
            self._pools[box.image].ready.remove(box)
        async with trio.open_nursery() as nursery:
            for box in idle + old:
                nursery.start_soon(self._retire, box)

    async def _retire(self, box: _Box) -> None:
        log.info("sandbox.container_retired", container=box.name,
                 age_s=round(trio.current_time() - box.born, 1))
        await box.remove()
        self._pools[box.image].changed()

    async def _remove_all(self) -> None:
        """Remove every container: those it tracks, then any the engine still lists under
        this instance's label (a create or a removal whose answer was lost), logged."""
        for pool in self._pools.values():
            pool.ready.clear()
        async with trio.open_nursery() as nursery:
            for box in list(self._boxes.values()):
                nursery.start_soon(box.remove)
        labels = [LABEL, f"streamrl.instance={self.instance}"]  # (both: the proxy's rule)
        try:
            left = await self._aio(
                self._docker.containers.list(all=True, filters=json.dumps({"label": labels}))
            )
        except Exception as exc:  # the engine is unreachable: nothing more to do here
            log.warning("sandbox.leftovers_unlisted", error=repr(exc))
            return
        if left:
            names = [_container_name(item) for item in left]
            log.warning("sandbox.leftovers_removed", containers=names)
            async with trio.open_nursery() as nursery:
                for item, name in zip(left, names, strict=True):
                    nursery.start_soon(self._delete, item, name)

    # -- the pool ------------------------------------------------------------------------

    def _pool(self, image: str) -> _Pool:
        pool = self._pools.get(image)
        if pool is None:
            pool = self._pools[image] = _Pool()
            assert self._nursery is not None
            self._nursery.start_soon(self._serve_pool, image, pool)
        return pool

    async def _acquire(self, image: str, limits: Limits, label: str) -> _Box:
        """A ready container of ``image``: from the pool, else the next one being reset, else
        a cold one (beyond ``pool_size``, removed again when given back)."""
        await self._start()
        pool = self._pool(image)
        while not pool.ready and pool.resetting:
            await pool.wait_changed()
        box = None
        while pool.ready and box is None:
            box = pool.ready.pop()
            if self._worn(box):
                assert self._nursery is not None
                self._nursery.start_soon(self._retire, box)
                box = None
        if box is not None:
            self._counts["reused"] += 1
        else:
            box = await self._create(image)
        pool.changed()
        try:
            await box.prepare(limits, label)
        except BaseException:
            self._discard(box)
            raise
        return box

    def _release(self, box: _Box) -> None:
        """Give a box back: reset it (in the background) and return it to its pool, or remove it."""
        if self._nursery is None or self._closing.is_set():
            return
        self._nursery.start_soon(self._recycle, box)

    async def _recycle(self, box: _Box) -> None:
        pool = self._pools[box.image]
        surplus = self._count(box.image) > self.pool_size
        if box.gone is None and not surplus and not self._worn(box):
            pool.resetting += 1
            try:
                await box.renamed()  # a run's label rename still on its way lands first
                await box.reset()
                await box.rename(box.pool_name)  # no longer the episode's
                pool.ready.append(box)
                return
            except (RunnerGone, SandboxUnavailable) as exc:
                log.warning("sandbox.reset_failed", container=box.name, error=str(exc))
            finally:
                pool.resetting -= 1
                pool.changed()
        await box.remove()
        pool.changed()

    def _label_name(self, label: str) -> str:
        # the backend instance keeps names unique across executors on one engine
        return f"streamrl-{_safe_name(label)}-{self.instance}-{next(self._seq)}"

    def _discard(self, box: _Box) -> None:
        if self._nursery is not None:
            self._nursery.start_soon(box.remove)

    def _count(self, image: str) -> int:
        return sum(1 for box in self._boxes.values() if box.image == image and box.gone is None)

    async def _serve_pool(self, image: str, pool: _Pool) -> None:
        """Keep ``pool_size`` live containers of ``image``; back off while Docker fails."""
        retrying = Retrying(Backoff(0.5, 30.0))
        while True:
            while self._count(image) < self.pool_size:
                try:
                    pool.ready.append(await self._create(image))
                    pool.changed()
                    retrying.reset()
                except SandboxUnavailable as exc:
                    log.warning("sandbox.pool_fill_failed", image=image, error=str(exc))
                    await retrying.wait()
            await pool.wait_changed()

    async def _create(self, image: str) -> _Box:
        """A started container of ``image`` whose runner answered, within the fleet's
        bounds: a slot of ``max_containers`` (held until it is removed), one of
        ``max_starting`` while it starts, and a token of the creation rate."""
        await self._slots.acquire()
        try:
            async with self._starting_slots:
                await self._create_rate.take()
                self._starting += 1
                counts = self._counts
                counts["max_starting_seen"] = max(counts["max_starting_seen"], self._starting)
                try:
                    return await self._start_container(image)
                finally:
                    self._starting -= 1
        except BaseException:
            self._slots.release()
            raise

    async def _start_container(self, image: str) -> _Box:
        import aiodocker

        name = f"streamrl-sbx-{self.instance}-{next(self._seq)}"
        born = trio.current_time()  # before the engine's own creation time
        container = stream = None
        try:
            # shielded: a create cut short on our side may still complete in the engine,
            # leaving a container nothing tracks (created, never started, never removed)
            with trio.CancelScope(shield=True), trio.fail_after(self._start_timeout):
                created = await self._aio(
                    self._docker.containers.create(self._config(image), name=name)
                )
            container = created
            stream = created.attach(stdin=True, stdout=True, stderr=True)
            await self._aio(stream.__aenter__())
            await self._aio(created.start())
            box = _Box(self, created, stream, name, image, self.limits, born)
            hello = await box.channel.wait_ready(self._start_timeout)
        except BaseException as exc:
            with trio.CancelScope(shield=True):
                if stream is not None:
                    with contextlib.suppress(Exception):
                        await self._aio(stream.close())
                if container is None:  # a create that timed out may still have made it
                    container = self._docker.containers.container(name)
                with contextlib.suppress(Exception):
                    await self._delete(container, name, deadline_s=10, by_name=True)
            if isinstance(exc, (aiodocker.DockerError, RunnerGone, trio.TooSlowError, OSError)):
                raise SandboxUnavailable(f"cannot start a container of {image}: {exc}") from exc
            raise
        self._boxes[box.id] = box
        self._counts["created"] += 1
        log.debug("sandbox.container_started", name=name, image=image, runner=hello)
        return box

    def _config(self, image: str) -> dict[str, Any]:
        limits = self.limits
        work_mb, tmp_mb, shm_mb = self._mounts
        mib = 1 << 20
        nofile = max(limits.max_open_files, 64)
        host: dict[str, Any] = {
            "NetworkMode": "none",
            "CapDrop": ["ALL"],
            "SecurityOpt": ["no-new-privileges:true"],
            "Privileged": False,
            "ReadonlyRootfs": True,
            "Tmpfs": {
                "/work": f"rw,nosuid,nodev,size={work_mb}m,uid={SANDBOX_UID},"
                f"gid={SANDBOX_UID},mode=0700",
                "/tmp": f"rw,nosuid,nodev,noexec,size={tmp_mb}m,mode=1777",
            },
            "IpcMode": "private",
            "ShmSize": shm_mb * mib,
            "Memory": (limits.memory_mb + RUNNER_MB) * mib,
            "MemorySwap": (limits.memory_mb + RUNNER_MB) * mib,
            "NanoCpus": int(self._cpus * 1e9),
            "PidsLimit": limits.max_processes + RUNNER_PIDS,
            "Ulimits": [
                {"Name": "nofile", "Soft": nofile, "Hard": nofile},
                {
                    "Name": "fsize",
                    "Soft": limits.max_file_mb * mib,
                    "Hard": limits.max_file_mb * mib,
                },
                {"Name": "core", "Soft": 0, "Hard": 0},
            ],
            "Init": True,
            "OomScoreAdj": 500,
            "AutoRemove": True,
            "LogConfig": {"Type": "none", "Config": {}},
        }
        if self._runtime:
            host["Runtime"] = self._runtime
        return {
            "Image": image,
            "Entrypoint": [self._python, "-I", "-S", "-c", RUNNER_SOURCE],
            "Cmd": [],
            "User": f"{SANDBOX_UID}:{SANDBOX_UID}",
            "WorkingDir": "/work",
            "Env": ["PATH=/usr/local/bin:/usr/bin:/bin", "LANG=C.UTF-8"],
            "Hostname": "sandbox",
            "NetworkDisabled": True,
            "AttachStdin": True,
            "AttachStdout": True,
            "AttachStderr": True,
            "OpenStdin": True,
            "StdinOnce": True,
            "Tty": False,
            "Labels": {LABEL: "1", "streamrl.instance": self.instance, "streamrl.owner": _owner()},
            "HostConfig": host,
        }


@asynccontextmanager
async def open_docker_sandbox(
    image: str = DEFAULT_IMAGE, **options: Any
) -> AsyncIterator[DockerSandbox]:
    """A :class:`DockerSandbox` served in a nursery of its own for the ``async with``
    (connected, or its connection failure kept for the calls); on exit every container of
    it is removed."""
    sandbox = DockerSandbox(image, **options)
    async with trio.open_nursery() as nursery:
        await nursery.start(sandbox.serve)
        try:
            yield sandbox
        finally:
            await sandbox.aclose()


class _Pool:
    """The ready containers of one image, and a signal for every change."""

    def __init__(self) -> None:
        self.ready: list[_Box] = []
        self.resetting = 0
        self._changed = trio.Event()

    def changed(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_changed(self) -> None:
        await self._changed.wait()


class DockerSession:
    """One episode's container: files persist across ``run`` until ``reset`` (see base).

    Every ``run`` uses the session's limits. Host-side file access never follows what the code
    planted: ``get_files`` reads regular files only (a link, fifo or directory maps to None),
    ``put_files`` replaces links and other things in the way of its paths. Once the session
    is ``session_max_s`` old, every call raises :class:`SessionExpired`."""

    def __init__(self, sandbox: DockerSandbox, limits: Limits, label: str) -> None:
        self._sandbox = sandbox
        self._limits = limits
        self._label = label
        self._box: _Box | None = None
        self._lock = trio.Lock()
        self._opened = trio.current_time()
        self._expired = False

    def expired(self) -> bool:
        """Whether it is past the backend's ``session_max_s`` (counted, and logged, once)."""
        limit = self._sandbox._session_max
        if self._expired or not limit or trio.current_time() - self._opened < limit:
            return self._expired
        self._expired = True
        self._sandbox._counts["expired"] += 1
        log.warning("sandbox.session_expired", label=self._label, container=self.container_name,
                    session_max_s=limit)
        return True

    async def drop_if_expired(self) -> None:
        """The sweep's part: an expired session no call holds loses its container now (its
        holder may have abandoned it; every later call is refused anyway)."""
        if self._box is not None and self.expired() and not self._lock.locked():
            box, self._box = self._box, None
            await box.remove()
            self._sandbox._pools[box.image].changed()

    @property
    def container_name(self) -> str | None:
        return None if self._box is None else self._box.name

    async def open(self) -> None:
        self._box = await self._sandbox._acquire(self._sandbox.image, self._limits, self._label)

    async def run(self, request: ExecRequest) -> ExecResult:
        """Write ``request.files``, run ``request.argv`` under the session's limits."""
        with self._sandbox._call():
            async with self._lock:
                box = self._live_box()
                return await box.run(replace(request, limits=self._limits))

    async def put_files(self, files: dict[str, bytes]) -> None:
        with self._sandbox._call():
            async with self._lock:
                await self._live_box().channel.put_files(files)

    async def get_files(self, paths: list[str]) -> dict[str, bytes | None]:
        with self._sandbox._call():
            async with self._lock:
                return await self._live_box().channel.get_files(
                    paths, self._limits.max_file_mb << 20
                )

    async def reset(self) -> None:
        """Back to a clean state: the same container reset, or a fresh one if that fails."""
        with self._sandbox._call():
            async with self._lock:
                self._refuse_expired()
                await self._reset()

    async def _reset(self) -> None:
        box = self._box
        if box is not None and box.gone is None:
            try:
                await box.reset()
                return
            except (RunnerGone, SandboxUnavailable) as exc:
                log.warning("sandbox.reset_failed", container=box.name, error=str(exc))
        if box is not None:
            self._box = None
            self._sandbox._discard(box)
            self._sandbox._counts["replaced"] += 1
        self._box = await self._sandbox._acquire(self._sandbox.image, self._limits, self._label)

    async def aclose(self) -> None:
        box, self._box = self._box, None
        if box is not None:
            self._sandbox._release(box)

    def _refuse_expired(self) -> None:
        if self.expired():
            raise SessionExpired(
                f"sandbox session {self._label or '(unlabelled)'} is past the backend's "
                f"session_max_s ({self._sandbox._session_max:g} s): refused")

    def _live_box(self) -> _Box:
        self._refuse_expired()
        if self._sandbox._error is not None:
            raise self._sandbox._unavailable()
        if self._box is None:
            raise SandboxUnavailable("the sandbox session is closed")
        if self._box.gone is not None:
            raise SandboxUnavailable(f"the sandbox container is gone ({self._box.gone})")
        return self._box


class _Box:
    """One started container; the conversation with its runner is ``channel``."""

    def __init__(
        self,
        sandbox: DockerSandbox,
        container: Any,
        stream: Any,
        name: str,
        image: str,
        limits: Limits,
        born: float,
    ) -> None:
        self.sandbox = sandbox
        self.born = born  # trio's clock, just before the create
        self.container = container
        self.stream = stream
        self.id: str = container.id
        self.name = self.pool_name = name
        self.image = image
        self.cgroup = (limits.memory_mb, limits.max_processes)
        self._removed = False
        self._renaming: trio.Event | None = None
        self._rename_wait: trio.CancelScope | None = None
        self.channel = RunnerChannel(_Attached(sandbox, stream), discard=self.remove)

    @property
    def gone(self) -> str | None:
        """Why the container cannot be used any more, or None while it can."""
        return self.channel.gone

    async def prepare(self, limits: Limits, label: str) -> None:
        """Match the cgroup to ``limits`` and name the container after ``label``."""
        aio, docker = self.sandbox._aio, self.sandbox._docker
        wanted = (limits.memory_mb, limits.max_processes)
        if wanted != self.cgroup:
            memory = (limits.memory_mb + RUNNER_MB) << 20
            update = {"Memory": memory, "MemorySwap": memory,
                      "PidsLimit": limits.max_processes + RUNNER_PIDS}  # fmt: skip
            try:
                await aio(docker._query_json(f"containers/{self.id}/update", "POST", data=update))
            except Exception as exc:
                raise SandboxUnavailable(f"cannot update container limits: {exc}") from exc
            self.cgroup = wanted
        if label:
            await self.rename(self.sandbox._label_name(label))

    def rename_soon(self, name: str, delay_s: float) -> None:
        """Rename the container in the background after ``delay_s``, unless
        :meth:`skip_pending_rename` comes first (a failure is logged: the run goes on);
        :meth:`renamed` waits for it."""

        async def rename() -> None:
            try:
                with wait:
                    await trio.sleep(delay_s)
                self._rename_wait = None
                if not wait.cancelled_caught:
                    await self.rename(name)
            except SandboxUnavailable as exc:
                if self.gone is None:
                    log.warning("sandbox.rename_failed", container=self.name, error=str(exc))
            finally:
                done.set()

        nursery = self.sandbox._nursery
        if nursery is None or self.sandbox._closing.is_set():
            return
        wait = self._rename_wait = trio.CancelScope()
        done = self._renaming = trio.Event()
        nursery.start_soon(rename)

    def skip_pending_rename(self) -> None:
        """Call off a :meth:`rename_soon` still waiting for its delay (one under way lands)."""
        if self._rename_wait is not None:
            self._rename_wait.cancel()

    async def renamed(self) -> None:
        if self._renaming is not None:
            await self._renaming.wait()
            self._renaming = None

    async def rename(self, name: str) -> None:
        if name == self.name:
            return
        try:
            await self.sandbox._aio(self.container.rename(name))
        except Exception as exc:
            raise SandboxUnavailable(f"cannot rename container {self.name}: {exc}") from exc
        self.name = name

    async def run(self, request: ExecRequest) -> ExecResult:
        limits = request.limits
        start = time.monotonic()
        try:
            return await self.channel.run(request, limits, limits.timeout_s + self.sandbox._grace)
        except RunnerGone as exc:
            if await self.sandbox._engine_failed(exc):
                raise self.sandbox._unavailable() from exc
            oom = await self._oom_killed()
            await self.remove()
            return lost_result(exc, "container removed", oom, start)

    async def reset(self) -> None:
        await self.channel.reset()

    async def remove(self) -> None:
        """Kill and remove the container (idempotent, shielded); returns once the engine no
        longer lists it (or after ``REMOVE_WAIT_S``, logged)."""
        if self._removed:
            return
        self._removed = True
        self.channel.gone = self.channel.gone or "removed"
        sandbox = self.sandbox
        with trio.CancelScope(shield=True):
            with contextlib.suppress(Exception):
                await sandbox._aio(self.stream.close())
            with contextlib.suppress(SandboxUnavailable):  # (the loop is gone)
                await sandbox._delete(self.container, self.name)
        if sandbox._boxes.pop(self.id, None) is not None:
            sandbox._slots.release()
            sandbox._counts["removed"] += 1

    async def _oom_killed(self) -> bool:
        with contextlib.suppress(Exception):
            info = await self.sandbox._aio(self.container.show())
            return bool(info["State"].get("OOMKilled"))
        return False


class _Attached:
    """The container's attached stdin/stdout/stderr (aiodocker): a :class:`RunnerTransport`."""

    def __init__(self, sandbox: DockerSandbox, stream: Any) -> None:
        self._aio = sandbox._aio
        self._stream = stream
        self._diag = bytearray()

    async def send(self, data: bytes) -> None:
        try:
            await self._aio(self._stream.write_in(data))
        except Exception as exc:  # as in receive: a lost runner, never a raw aiohttp error
            raise RunnerGone(f"cannot write to the runner: {exc!r}") from exc

    async def receive(self) -> bytes:
        while True:
            try:
                message = await self._aio(self._stream.read_out())
            except Exception as exc:
                raise RunnerGone(f"connection to the runner failed: {exc!r}") from exc
            if message is None:
                return b""
            if message.stream == 1:
                if message.data:
                    return bytes(message.data)
            elif len(self._diag) < 1 << 16:
                self._diag += message.data

    def diagnostics(self) -> str:
        return bytes(self._diag[-500:]).decode(errors="replace")


def _safe_name(label: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_.-]", "_", label)[:64] or "x"


def _start_ticks(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[19].decode()
    except (OSError, IndexError):
        return None


def _container_name(item: Any) -> str:
    """A listed container's name; its short id where the engine lists it without one (a
    container whose removal is in progress is listed with ``Names: []``: in one CI run that
    failed every sweep with an IndexError, after the sweep had removed and before it had
    counted another container)."""
    names = item["Names"] or []
    return str(names[0]).lstrip("/") if names else str(item["Id"])[:12]


def _owner_dead(owner: str | None) -> bool:
    """True when ``owner`` (host/pid/start ticks) names a process of this host that is gone."""
    if not owner or owner.count("/") != 2:
        return False
    host, pid, ticks = owner.split("/")
    if host != _host() or not pid.isdigit():
        return False
    return _start_ticks(int(pid)) != ticks


def _host() -> str:
    """This host and pid namespace: executors in containers on the host network share the
    host's name, and their pids mean nothing in each other's namespace."""
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return socket.gethostname()
    return f"{socket.gethostname()}~{namespace}"


def _owner() -> str:
    """This process, as ``host/pid/start ticks`` (a reused pid has other start ticks)."""
    return f"{_host()}/{os.getpid()}/{_start_ticks(os.getpid())}"
