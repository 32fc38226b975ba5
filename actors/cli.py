"""The ``streamrl`` command.

    streamrl up --config configs/demo.toml [--max-minutes M] [--summary-json PATH]
    streamrl run {scheduler,generator,executor,verifier,learner} --config FILE
    streamrl status --config FILE [--json]

Every command takes ``--set section.key=value`` overrides (repeatable).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from typing import Any

import msgspec
import trio

from actors.config import Config, ConfigError, load_config, to_dict
from actors.logs import configure_logging, get_logger

ACTORS = ("scheduler", "generator", "executor", "verifier", "learner")


def _serve_function(actor: str) -> Any:
    import importlib

    return importlib.import_module(f"actors.{actor}").serve


async def run_actor(actor: str, config: Config, drain_timeout_s: float = 60.0) -> None:
    """Serve one actor; SIGINT/SIGTERM drains it (work in hand settles), a second one stops it."""
    from actors.context import open_context

    serve = _serve_function(actor)
    log = get_logger()
    async with open_context(config) as ctx:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:

                async def serve_and_finish() -> None:
                    await serve(ctx)
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
                nursery.start_soon(serve_and_finish)
                log.info("actor started", run=config.run.name)
        log.info("actor stopped")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="streamrl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--config", help="deployment TOML (configs/*.toml)")
        sp.add_argument(
            "--set",
            dest="overrides",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a config field, e.g. learner.lr=2e-5",
        )

    up = sub.add_parser("up", help="run the whole pipeline on this machine (embedded default)")
    common(up)
    up.add_argument("--max-minutes", type=float, default=0.0, help="stop after M minutes")
    up.add_argument("--summary-json", help="write the run summary (eval before/after, ...) here")
    run = sub.add_parser("run", help="run one actor (replicate by starting more)")
    run.add_argument("actor", choices=ACTORS)
    common(run)
    status = sub.add_parser("status", help="queue depths, policy version, dead letters")
    common(status)
    status.add_argument("--json", action="store_true")
    show = sub.add_parser("config", help="print the merged config as JSON")
    common(show)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
    except (ConfigError, OSError) as exc:
        print(f"streamrl: {exc}", file=sys.stderr)
        return 2
    if args.command == "config":
        print(json.dumps(to_dict(config), indent=2))
        return 0
    if args.command == "run":
        configure_logging(actor=args.actor)
        get_logger().info("config", config=to_dict(config))
        try:
            trio.run(run_actor, args.actor, config)
        except KeyboardInterrupt:
            return 130
        return 0
    if args.command == "status":
        from actors.status import print_status

        configure_logging(actor="status", level="warning")
        return trio.run(print_status, config, args.json)
    if args.command == "up":
        from actors.supervisor import run_up

        summary = run_up(config, args.config, args.overrides, max_minutes=args.max_minutes)
        if args.summary_json:
            with open(args.summary_json, "w") as f:
                json.dump(msgspec.to_builtins(summary), f, indent=2)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
