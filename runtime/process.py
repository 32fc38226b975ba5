"""One actor as a process: ``run_actor`` opens its context (Redis, config, metrics) and serves
it until SIGINT/SIGTERM, which drains it (work in hand settles; a second signal stops it).
The entry of ``streamrl run <actor>`` and of the torchrun learner (``actors/learner.py``);
it imports no command-line code, so those can import it without a cycle."""

from __future__ import annotations

import importlib
import signal
from typing import Any

import trio

from streamrl.config.schema import Config
from streamrl.runtime.logs import get_logger

ACTORS = ("scheduler", "generator", "executor", "verifier", "learner", "archiver")


def _serve_function(actor: str) -> Any:
    return importlib.import_module(f"streamrl.actors.{actor}").serve


async def run_actor(actor: str, config: Config, drain_timeout_s: float = 60.0) -> Any:
    """Serve one actor; SIGINT/SIGTERM drains it (work in hand settles), a second one stops it.
    Returns what the actor's ``serve`` returned (None when it was cancelled)."""
    from streamrl.runtime.context import open_context

    serve = _serve_function(actor)
    log = get_logger()
    result = None
    if config.ops.metrics_port:
        from streamrl.runtime.metrics import start_metrics_server

        start_metrics_server(config.ops.metrics_port, config.ops.metrics_addr)
    async with open_context(config, actor) as ctx:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:

                async def serve_and_finish(*, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
                    nonlocal result
                    result = await serve(ctx, task_status=task_status)
                    nursery.cancel_scope.cancel()

                async def on_signals() -> None:
                    async for signum in signals:
                        if ctx.shutdown.is_set():
                            break
                        log.info("draining", signal=signum)
                        ctx.shutdown.set()
                        if actor in ("scheduler", "learner"):
                            break  # nothing in hand worth finishing: stop now
                        nursery.cancel_scope.deadline = trio.current_time() + drain_timeout_s
                    nursery.cancel_scope.cancel()

                nursery.start_soon(on_signals)
                log.info("actor started", run=config.run.name)
                await nursery.start(serve_and_finish)
                log.info("actor ready", run=config.run.name)  # set up, taking work
            if ctx.shutdown.is_set() and trio.current_time() >= nursery.cancel_scope.deadline:
                log.warning("drain deadline passed, work in hand left to the reclaimers",
                            drain_timeout_s=drain_timeout_s)
        log.info("actor stopped")
    return result
