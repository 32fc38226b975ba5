"""A pool of killable worker processes: run a function elsewhere, under a deadline.

Guarantees:
- ``await pool.run(fn, *args, deadline_s=...)`` runs ``fn(*args)`` in one of ``size``
  pre-forked worker processes (``spawn`` context: a fresh interpreter, no inherited locks or
  threads) and returns its result, or raises :class:`WorkerFailed` when the worker missed the
  deadline or died (``os._exit``, a segfault, the OOM killer) or the caller was cancelled
  meanwhile. In each of those cases the worker is SIGKILLed and a fresh one takes its place,
  so a hung or crashed job costs the caller one failure (a :class:`Retry`: the runtime's
  retry policy retries, then dead-letters) and never a stuck slot or a dead pool.
- an exception ``fn`` raises is returned to the caller as :class:`WorkerError` (with the
  worker's traceback text); the worker lives on.
- workers are reused: a job pays one pipe round trip, not a process start. ``fn`` and its
  arguments cross by pickle over a private pipe between this process and its own child (not
  a wire format: nothing else reads it), so ``fn`` must be importable by name.
- ``preload`` (module names) are imported and ``initializer`` (importable by name) runs
  once in each worker before it is first handed a job, so no job's deadline pays for them:
  the place to register what the jobs look up (domains registered in-process, say).
- the pool is an async context manager (:func:`open_worker_pool`): leaving it kills every
  worker. Nothing here polls: a result is awaited with ``trio.lowlevel.wait_readable``.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing as mp
import os
import signal
import traceback
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import structlog
import trio

from streamrl.runtime.policies import Retry

log = structlog.get_logger()


class WorkerFailed(Retry):
    """The worker missed its deadline or died: it was killed and replaced."""


class WorkerTimedOut(WorkerFailed):
    """The worker missed its deadline (killed, replaced)."""


class WorkerError(Exception):
    """The job raised in the worker; the message holds the worker's traceback."""


def _serve_jobs(
    conn: Connection, initializer: Callable[[], None] | None, preload: tuple[str, ...]
) -> None:  # the child
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when a worker ends
    for module in preload:
        importlib.import_module(module)
    if initializer is not None:
        initializer()
    conn.send((True, "ready"))
    while True:
        try:
            fn, args = conn.recv()
        except EOFError:
            return
        try:
            reply: tuple[bool, Any] = (True, fn(*args))
        except BaseException:
            reply = (False, traceback.format_exc(limit=20)[-4000:])
        try:
            conn.send(reply)
        except Exception:  # an unpicklable result: tell the caller instead of hanging it
            conn.send((False, traceback.format_exc(limit=5)[-4000:]))


@dataclass(eq=False)
class _Worker:
    process: BaseProcess
    conn: Connection

    def kill(self, grace_s: float = 0.0) -> None:
        """Close its pipe (an idle worker reads EOF and exits, its own children reaped) and
        SIGKILL it if it is still there after ``grace_s``."""
        with contextlib.suppress(OSError):
            self.conn.close()
        if grace_s > 0:
            self.process.join(grace_s)
        if self.process.exitcode is None and self.process.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGKILL)
        self.process.join()


@dataclass(frozen=True)
class WorkerStatistics:
    size: int
    jobs: int
    failed: int  # deadline missed, died or cancelled: killed and replaced
    replaced: int


class WorkerPool:
    def __init__(
        self,
        size: int,
        initializer: Callable[[], None] | None = None,
        preload: tuple[str, ...] = (),
        start_timeout_s: float = 120.0,
    ) -> None:
        if size < 1:
            raise ValueError("a worker pool needs at least one process")
        self.size = size
        self._initializer = initializer
        self._preload = preload
        self._start_timeout_s = start_timeout_s
        self._ctx = mp.get_context("spawn")
        self._idle_send, self._idle = trio.open_memory_channel[_Worker](size)
        self._all: set[_Worker] = set()
        self._nursery: trio.Nursery | None = None
        self._jobs = self._failed = self._replaced = 0

    def statistics(self) -> WorkerStatistics:
        return WorkerStatistics(self.size, self._jobs, self._failed, self._replaced)

    def _start_worker(self) -> _Worker:  # blocking: run in a thread
        parent, child = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(
            # not a daemon: a scorer may start processes of its own (domains.math's sympy
            # worker); a worker whose parent is gone reads EOF on its pipe and exits
            target=_serve_jobs, args=(child, self._initializer, self._preload), daemon=False,
            name="streamrl-worker",
        )
        process.start()
        child.close()
        worker = _Worker(process, parent)
        try:  # ready: imports done, initializer run (so no job's deadline pays for them)
            if not parent.poll(self._start_timeout_s) or parent.recv() != (True, "ready"):
                raise RuntimeError(f"worker not ready within {self._start_timeout_s}s")
        except (EOFError, OSError, RuntimeError) as exc:
            worker.kill()
            raise RuntimeError(f"worker failed to start (exit code {process.exitcode})") from exc
        return worker

    async def _add_worker(self) -> None:
        worker = await trio.to_thread.run_sync(self._start_worker)
        self._all.add(worker)
        self._idle_send.send_nowait(worker)

    async def _replace(self, worker: _Worker) -> None:
        self._all.discard(worker)
        await trio.to_thread.run_sync(worker.kill)
        self._replaced += 1
        await self._add_worker()

    async def run(self, fn: Callable[..., Any], *args: Any, deadline_s: float) -> Any:
        """``fn(*args)`` in a worker; :class:`WorkerFailed` past ``deadline_s`` or if it died."""
        assert self._nursery is not None, "use the pool inside open_worker_pool"
        worker = await self._idle.receive()
        self._jobs += 1
        healthy = False
        try:
            worker.conn.send((fn, args))
            with trio.move_on_after(deadline_s):
                await trio.lowlevel.wait_readable(worker.conn.fileno())
                ok, value = worker.conn.recv()
                healthy = True
                if not ok:
                    raise WorkerError(value)
                return value
            raise WorkerTimedOut(f"worker missed its {deadline_s}s deadline (killed, replaced)")
        except (EOFError, OSError) as exc:
            raise WorkerFailed(f"worker died (exit code {worker.process.exitcode}): "
                               f"{exc!r} (replaced)") from None
        finally:
            if healthy:
                self._idle_send.send_nowait(worker)
            else:  # hung, dead or interrupted mid-job: its state is unknown
                self._failed += 1
                log.warning("worker killed and replaced", pid=worker.process.pid)
                self._nursery.start_soon(self._replace, worker)


@asynccontextmanager
async def open_worker_pool(
    size: int, initializer: Callable[[], None] | None = None, preload: tuple[str, ...] = ()
) -> AsyncIterator[WorkerPool]:
    """A pool of ``size`` workers, each of which imports ``preload`` and runs ``initializer``
    before it takes a job (started in the background; ``run`` waits for an idle one). A worker
    that cannot start fails the pool (and its owner) loudly."""
    pool = WorkerPool(size, initializer, preload)
    try:
        async with trio.open_nursery() as nursery:
            pool._nursery = nursery
            for _ in range(size):
                nursery.start_soon(pool._add_worker)
            yield pool
            nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            for worker in list(pool._all):  # the busy ones were cancelled: replaced, gone
                await trio.to_thread.run_sync(worker.kill, 2.0)
            pool._all.clear()
