"""The operator subcommands of ``streamrl``: ``dlq``, ``replay``, ``report``, ``domains``.

    streamrl dlq list|show|requeue|purge [IDS...] [--stream S] [--error REGEX] [--all]
                 [--json] [--yes] [--out FILE] --config FILE
    streamrl replay list|show|rescore|retrain|export [selection] --config FILE
    streamrl report --out DIR --config FILE
    streamrl domains list|lift [NAMES...] [--json] --config FILE

They connect as the run's ``admin`` role where ``auth.enabled`` and its password
(``$STREAMRL_PASSWORD_ADMIN``) are set, else with ``run.redis_url`` as given (the operator's
credentials; runtime/auth.py ``ops_url``), give up on an unreachable Redis within seconds (exit
status 2) and import their heavy parts lazily. A run of ``up``'s embedded server (no
``run.redis_url``) is opened by its config (or ``<run dir>/config.json``): its server while
``up`` runs, else one started over the run's data for the command (:func:`open_run_redis`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import msgspec
import trio

from streamrl.config.schema import Config

OPS_COMMANDS = ("dlq", "replay", "report", "domains")


def add_ops_parsers(sub: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    dlq = sub.add_parser("dlq", help="list, show, requeue or purge dead letters")
    dlq.add_argument("action", choices=["list", "show", "requeue", "purge"])
    dlq.add_argument("ids", nargs="*", help="dead-letter entry ids (from `dlq list`)")
    dlq.add_argument("--stream", help="only letters from this stream (tasks, rollouts, ...)")
    dlq.add_argument("--error", help="only letters whose error matches this regex")
    dlq.add_argument("--all", action="store_true", help="every letter")
    dlq.add_argument("--json", action="store_true")
    dlq.add_argument("--yes", action="store_true", help="purge without asking")
    dlq.add_argument("--out", metavar="FILE",
                     help="show: write the letter's whole payload to FILE (blob resolved)")
    common(dlq)

    replay = sub.add_parser("replay", help="select, show, rescore, retrain, export trajectories")
    replay.add_argument("action", choices=["list", "show", "rescore", "retrain", "export"])
    replay.add_argument("--source", choices=["live", "archive", "both"], default="both")
    replay.add_argument("--archive", help="archive directory (default: <work_dir>/archive)")
    replay.add_argument("--stream", choices=["trajectories", "evals"], default=None)
    replay.add_argument("--from-id", help="first stream entry id (live)")
    replay.add_argument("--to-id", help="last stream entry id (live)")
    replay.add_argument("--since", type=float, help="created at or after (unix seconds)")
    replay.add_argument("--until", type=float, help="created before (unix seconds)")
    replay.add_argument("--domain")
    replay.add_argument("--episode", action="append", default=[], help="episode id (repeat)")
    replay.add_argument("--min-reward", type=float, help="group mean reward at least")
    replay.add_argument("--max-reward", type=float, help="group mean reward at most")
    replay.add_argument("--policy-version", type=int)
    replay.add_argument("--limit", type=int, default=0, help="at most N (0: all)")
    replay.add_argument("--checkpoint", help="retrain: weights directory v{N} to start from")
    replay.add_argument("--step", type=int, help="retrain: the recorded step to reproduce")
    replay.add_argument("--jsonl", help="export: JSONL path")
    replay.add_argument("--parquet", help="export: Parquet path")
    replay.add_argument("--sft", help="export: SFT data set path (JSONL token rows of the "
                        "training samples with reward >= --sft-min-reward)")
    replay.add_argument("--sft-min-reward", type=float,
                        help="export --sft: a sample's own reward at least")
    replay.add_argument("--json", action="store_true")
    common(replay)

    report = sub.add_parser("report", help="PNG charts and a Markdown summary of a run")
    report.add_argument("--out", required=True)
    report.add_argument("--archive", help="archive directory (default: <work_dir>/archive)")
    common(report)

    domains = sub.add_parser("domains", help="list quarantined domains, lift a quarantine")
    domains.add_argument("action", choices=["list", "lift"])
    domains.add_argument("names", nargs="*", help="lift: the domains to admit again")
    domains.add_argument("--json", action="store_true")
    common(domains)


NO_RUN_HINT = (
    "give the run's config (--config FILE, or the merged <run dir>/config.json `up` wrote; "
    "--set run.name=NAME / run.work_dir=DIR), or set $STREAMRL_REDIS_URL for a run on an "
    "external Redis; `replay --source archive` reads the archive alone"
)


@contextmanager
def open_run_redis(config: Config) -> Iterator[Config]:
    """``config`` with the Redis URL of its run: as given where ``run.redis_url`` is set; for
    a run of ``up``'s embedded server (no URL), that server while ``up`` runs, else one
    started over the run's data (``<run dir>/redis``) for the block and stopped after it.
    RedisUnreachable (saying what to give) when there is neither."""
    from streamrl.cli.status import RedisUnreachable
    from streamrl.queues.server import DataDirBusy, open_data_dir

    if config.run.redis_url:
        yield config
        return
    data = config.run.path / "redis"
    with ExitStack() as stack:
        try:
            url = stack.enter_context(
                open_data_dir(data, config.run.redis_server, config.run.redis_allocator)
            )
        except FileNotFoundError as exc:
            raise RedisUnreachable(
                f"run.redis_url is empty and {exc}: {NO_RUN_HINT}{_runs_beside(config)}"
            ) from None
        except DataDirBusy as exc:  # `up` holds it, its server (re)starting
            raise RedisUnreachable(f"{exc}, and no server answers there yet: try again in a "
                                   "moment") from None
        except (RuntimeError, TimeoutError) as exc:
            raise RedisUnreachable(f"the server over the run's data in {data}: {exc}") from None
        yield msgspec.structs.replace(config, run=msgspec.structs.replace(config.run,
                                                                          redis_url=url))


def _runs_beside(config: Config) -> str:
    """The runs of the embedded server beside this run's directory, as a hint (or "")."""
    from streamrl.queues.server import has_data

    found = sorted(p for p in config.run.path.parent.glob("*") if has_data(p / "redis"))
    if not found:
        return ""
    listed = ", ".join(f"--config {p / 'config.json'}" for p in found[:5])
    return f"; runs found in {config.run.path.parent}: {listed}"


def run_ops_command(args: argparse.Namespace, config: Config) -> int:
    """The operator command ``args.command`` on the run of ``config``; its exit status."""
    from streamrl.cli.status import RedisUnreachable

    if args.command == "replay" and args.source == "archive" and not config.run.redis_url:
        # the archive alone needs no Redis (e.g. an embedded run's server is gone)
        from streamrl.cli.replay import run_replay
        from streamrl.protocol.names import Names

        names = Names(config.run.name, shards=config.queues.shards)
        return trio.run(run_replay, None, names, config, args)
    try:
        with open_run_redis(config) as connected:
            return _run_connected(args, connected)
    except RedisUnreachable as exc:
        print(f"streamrl {args.command}: {exc}", file=sys.stderr)
        return 2


def broker_failure(exc: Exception, where: str) -> str:
    """What an operator command's broker failure was, in a line: refused by the ACL (the
    user lacks a permission: NOPERM), refused otherwise (an error reply), or Redis not
    reached (connection, timeout)."""
    from streamrl.queues.operations import AclRefused, BrokerRefused

    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, AclRefused) or "NOPERM" in str(exc):
        return (f"refused by Redis's ACL at {where}: {text} (the run's admin user lacks a "
                f"permission: `streamrl up` or `streamrl acl apply` creates it as needed)")
    if isinstance(exc, BrokerRefused):
        return f"refused by Redis at {where}: {text}"
    return f"cannot reach Redis at {where}: {text}"


def _run_connected(args: argparse.Namespace, config: Config) -> int:
    """``run_ops_command`` once ``config.run.redis_url`` names the run's server."""
    from streamrl.cli.status import RedisUnreachable, ops_client
    from streamrl.protocol.names import Names
    from streamrl.queues.client import RedisURL
    from streamrl.queues.operations import BrokerError

    names = Names(config.run.name, shards=config.queues.shards)
    try:
        client = ops_client(config)
    except (RedisUnreachable, ValueError) as exc:
        print(f"streamrl {args.command}: {exc}", file=sys.stderr)
        return 2
    try:
        if args.command == "dlq":
            from streamrl.cli.dlq import Selection, run_dlq

            selection = Selection(tuple(args.ids), args.stream, args.error, args.all)
            return trio.run(
                lambda: run_dlq(
                    client, names, args.action, selection, as_json=args.json, yes=args.yes,
                    out=args.out,
                )
            )
        if args.command == "replay":
            from streamrl.cli.replay import run_replay

            return trio.run(run_replay, client, names, config, args)
        if args.command == "report":
            from streamrl.cli.report import run_report

            return trio.run(run_report, client, names, config, args)
        if args.command == "domains":
            from streamrl.cli.domains import run_domains

            if args.action == "lift" and not args.names:
                print("streamrl domains lift: name the domains to lift", file=sys.stderr)
                return 2
            return trio.run(
                lambda: run_domains(client, names, args.action, args.names, as_json=args.json)
            )
    except BrokerError as exc:  # unreachable, refused, not Redis: say so, briefly
        where = RedisURL(config.run.redis_url).redacted
        print(f"streamrl {args.command}: {broker_failure(exc, where)}", file=sys.stderr)
        return 2
    finally:
        client.close()
    return 2
