"""The ``streamrl`` command.

    streamrl up --config configs/demo.toml [--max-minutes M] [--summary-json PATH]
    streamrl run {scheduler,generator,executor,verifier,learner} --config FILE
    streamrl status --config FILE [--json] [--watch] [--top N | --all]
    streamrl dlq|replay|report|domains ... (see cli/ops.py)
    streamrl coldstart --config FILE --out ROWS.jsonl [--domain repo] [--episodes N]
    streamrl acl apply --config FILE
    streamrl serve-model --model tiny|smollm2|DIR --port P [--host 127.0.0.1]
    streamrl serve-vllm --model tiny|smollm2|DIR --port P [--host 127.0.0.1]

Every command takes ``--set section.key=value`` overrides (repeatable).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import msgspec
import trio

from streamrl.cli.coldstart import add_coldstart_parser, run_coldstart
from streamrl.cli.ops import OPS_COMMANDS, add_ops_parsers, open_run_redis, run_ops_command
from streamrl.config.schema import ENV_REDIS_URL, Config, ConfigError, load_config, to_dict
from streamrl.queues.client import RedisURL
from streamrl.runtime.lifeline import exit_with_supervisor
from streamrl.runtime.logs import configure_logging, get_logger
from streamrl.runtime.process import ACTORS, run_actor
from streamrl.sandbox.base import IsolationTooWeak


async def apply_acl(config: Config) -> int:
    """Create or update the run's role users (auth.enabled) for actors started one by one:
    connected with the admin credentials of run.redis_url, the role passwords taken from the
    environment (the operator's ``admin`` role only where its password is set). Prints no
    secret."""
    from streamrl.protocol.roles import OPERATOR_ROLES
    from streamrl.runtime.auth import apply_role_users, credentials_for_apply

    if not config.auth.enabled:
        print("streamrl: auth.enabled is false in this config: no users to create", file=sys.stderr)
        return 2
    if not config.run.redis_url:
        print("streamrl: no Redis URL (set $STREAMRL_REDIS_URL to an admin URL)", file=sys.stderr)
        return 2
    try:
        credentials = credentials_for_apply(config)
    except ConfigError as exc:
        print(f"streamrl: {exc}", file=sys.stderr)
        return 2
    await apply_role_users(config, config.run.redis_url, credentials)
    print(f"streamrl: ACL users of run {config.run.name!r}:")
    for role, creds in credentials.items():
        variable = config.auth.password_env_of(role)
        print(f"  {role:<10} {creds.user}  (password from ${variable})")
    for role in OPERATOR_ROLES:
        if role not in credentials:
            variable = config.auth.password_env_of(role)
            print(f"  {role:<10} not created (set ${variable} to create it)")
    return 0


def warn_password_on_command_line(overrides: list[str]) -> bool:
    """Warn (stderr, in words and as a structlog event) when a ``--set run.redis_url=``
    override holds a password: a command line is visible to every user of the machine
    (``ps``, ``/proc/<pid>/cmdline``) for as long as the process runs. The secret is not
    repeated. True when it warned."""
    import structlog

    from streamrl.config.schema import _parse_value

    for item in overrides:
        key, _, value = item.partition("=")
        url = _parse_value(value.strip()) if key.strip() == "run.redis_url" else None
        if not (isinstance(url, str) and urlsplit(url).password):
            continue
        print(
            "streamrl: warning: the Redis password given with --set run.redis_url is visible "
            "to other users of this machine (ps); give the URL in the environment instead: "
            f"${ENV_REDIS_URL}=redis://:PASSWORD@HOST:PORT/0",
            file=sys.stderr,
            flush=True,
        )
        logger = structlog.wrap_logger(
            structlog.PrintLogger(sys.stderr),
            processors=[structlog.processors.add_log_level,
                        structlog.processors.TimeStamper(fmt="iso", utc=True),
                        structlog.processors.JSONRenderer()],
        )
        logger.warning("redis password on the command line", override="run.redis_url",
                       use=ENV_REDIS_URL)
        return True
    return False


def _isolation_refusal(exc: BaseException) -> IsolationTooWeak | None:
    """The executor's refusal to start with a weak sandbox (``executor.min_isolation``)."""
    if isinstance(exc, IsolationTooWeak):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for sub in exc.exceptions:
            if (found := _isolation_refusal(sub)) is not None:
                return found
    return None


def _public(config: Config) -> dict[str, Any]:
    """The config as printed and logged: the Redis URL without its password."""
    data = to_dict(config)
    with contextlib.suppress(ValueError):  # empty (embedded server) or not a URL
        data["run"]["redis_url"] = RedisURL(config.run.redis_url).redacted
    return data


def _status(args: argparse.Namespace, config: Config) -> int:
    """``streamrl status`` on the run's server (an embedded run's too: cli/ops.py
    ``open_run_redis``)."""
    from streamrl.cli.status import RedisUnreachable, print_status

    configure_logging(actor="status", level="warning")
    try:
        with open_run_redis(config) as connected:
            return trio.run(
                functools.partial(
                    print_status, connected, args.json, watch=args.watch, samples=args.samples,
                    interval_s=args.interval, top=None if args.all else max(0, args.top),
                )
            )
    except RedisUnreachable as exc:
        print(f"streamrl status: {exc}", file=sys.stderr)
        return 2


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
    up.add_argument(
        "--fresh",
        action="store_true",
        help="start the run over: delete its directory (weights, logs, embedded Redis data) "
        "first; without it an existing run is resumed",
    )
    up.add_argument(
        "--autoscale",
        action="store_true",
        help="add replicas of the stage whose backlog persists, remove idle ones "
        "(up.autoscale and its settings; docs/scaling.md)",
    )
    run = sub.add_parser("run", help="run one actor (replicate by starting more)")
    run.add_argument("actor", choices=ACTORS)
    common(run)
    run.add_argument("--metrics-port", type=int, help="this process's ops.metrics_port "
                     "(`up` gives each actor process its own)")
    status = sub.add_parser("status", help="queue depths, policy version, dead letters")
    common(status)
    status.add_argument("--json", action="store_true")
    status.add_argument("--watch", action="store_true", help="refresh every --interval s")
    status.add_argument("--samples", type=int, default=2, help="samples to judge the bottleneck")
    status.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    status.add_argument("--top", type=int, default=10, metavar="N",
                        help="domains shown: the N with the largest backlog, then failures")
    status.add_argument("--all", action="store_true", help="show every domain")
    add_ops_parsers(sub, common)
    add_coldstart_parser(sub, common)
    show = sub.add_parser("config", help="print the merged config as JSON")
    common(show)
    sub.add_parser("config-doc", help="print the configuration reference (docs/configuration.md)")
    acl = sub.add_parser("acl", help="create the per-role Redis users of a run (auth.enabled)")
    acl.add_argument("action", choices=["apply"])
    common(acl)
    serve_model = sub.add_parser(
        "serve-model", help="serve a model over the SGLang HTTP protocol subset (CPU)"
    )
    serve_model.add_argument("--model", default="tiny", help="tiny, smollm2 (or smollm2-135m, "
                                                             "as model.spec) or a HF directory")
    serve_model.add_argument("--host", default="127.0.0.1")
    serve_model.add_argument("--port", type=int, default=30000)
    serve_model.add_argument("--max-batch", type=int, default=32)
    serve_model.add_argument("--threads", type=int, default=1, help="torch threads (0: default)")
    serve_model.add_argument("--weight-version", default="default")
    serve_model.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"],
                             help="weights and compute (auto: bfloat16 where the CPU has it)")
    serve_model.add_argument("--openai-port", type=int, default=0,
                             help="also serve the OpenAI-compatible endpoint here (docs/agents.md)")
    serve_vllm = sub.add_parser(
        "serve-vllm", help="serve a model with vLLM, set up for streamrl's vLLM engine "
                           "(the environment `make vllm` builds; docs/inference.md)")
    serve_vllm.add_argument("--model", default="tiny", help="tiny, smollm2 (or smollm2-135m, "
                                                            "as model.spec) or a HF directory")
    serve_vllm.add_argument("--host", default="127.0.0.1")
    serve_vllm.add_argument("--port", type=int, default=8000)
    serve_vllm.add_argument("--threads", type=int, default=1, help="OpenMP threads (0: all CPUs)")
    serve_vllm.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                            help="weights and compute (auto: bfloat16 where the CPU has it)")
    serve_vllm.add_argument("--kv-cache-gib", type=int, default=2)
    serve_vllm.add_argument("--enforce-eager", action="store_true",
                            help="do not compile the model (starts faster, decodes slower)")
    serve_vllm.add_argument("--max-model-len", type=int, default=0,
                            help="longest sequence (0: the model's maximum positions)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "serve-vllm":  # watches the lifeline itself: takes vLLM down with it
        from streamrl.cli.serve_vllm import main_serve_vllm

        configure_logging(actor="serve-vllm")
        return main_serve_vllm(args.model, args.host, args.port, dtype=args.dtype,
                               threads=args.threads, kv_cache_gib=args.kv_cache_gib,
                               enforce_eager=args.enforce_eager,
                               max_model_len=args.max_model_len)
    exit_with_supervisor()  # a child of `streamrl up` dies with it (runtime/lifeline.py)
    if args.command == "serve-model":
        from streamrl.inference.server import main_serve_model

        configure_logging(actor="serve-model")
        return main_serve_model(args.model, args.host, args.port, args.max_batch, args.threads,
                                args.weight_version, args.openai_port, args.dtype)
    if args.command == "config-doc":
        from streamrl.config.doc import main as config_doc

        return config_doc()
    warn_password_on_command_line(args.overrides)
    try:
        overrides = list(args.overrides)
        if getattr(args, "autoscale", False):
            overrides.append("up.autoscale=true")
        config = load_config(args.config, overrides)
    except (ConfigError, OSError) as exc:
        print(f"streamrl: {exc}", file=sys.stderr)
        return 2
    if args.command == "config":
        print(json.dumps(_public(config), indent=2))
        return 0
    if args.command == "run":
        if args.metrics_port is not None:
            ops = msgspec.structs.replace(config.ops, metrics_port=args.metrics_port)
            config = msgspec.structs.replace(config, ops=ops)
        configure_logging(actor=args.actor)
        get_logger().info("config", config=_public(config))
        try:
            trio.run(run_actor, args.actor, config)
        except KeyboardInterrupt:
            return 130
        except (IsolationTooWeak, BaseExceptionGroup) as exc:
            refused = _isolation_refusal(exc)
            if refused is None:
                raise
            print(f"streamrl: {args.actor}: {refused}", file=sys.stderr)
            return 2
        return 0
    if args.command == "status":
        return _status(args, config)
    if args.command in OPS_COMMANDS:
        configure_logging(actor=args.command, level="warning")
        return run_ops_command(args, config)
    if args.command == "coldstart":
        configure_logging(actor="coldstart", level="warning")
        return run_coldstart(args, config)
    if args.command == "acl":
        return trio.run(apply_acl, config)
    if args.command == "up":
        from streamrl.cli.up import run_up

        run_up(config, max_minutes=args.max_minutes, fresh=args.fresh,
               summary_json=Path(args.summary_json) if args.summary_json else None)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
