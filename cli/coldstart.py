"""``streamrl coldstart``: write the tool-use cold start of a repository domain, an SFT data set
of successful demonstrations on its train tasks (domains/repo/coldstart.py).

    streamrl coldstart --config configs/agentic.toml --domain repo --out runs/coldstart.jsonl \\
        [--episodes 200] [--seed 0] [--concurrency 2]

The domain is built from its ``[domain.<name>]`` table (``tools.enabled``, kind
``repo_tests``), the sessions are opened by the executor's sandboxes as the config sets them
(backend, isolation), the rows are shaped by the config's model (its chat template) and
checked against the table's budgets (``max_turns``, ``max_tool_calls``, ``max_new_tokens``
or ``scheduler.max_new_tokens``, ``max_total_tokens``). Prints the statistics as JSON (kept,
dropped by reason); exit status 1 when no demonstration was kept, 2 for a config it cannot
use.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from streamrl.config.schema import Config


def add_coldstart_parser(sub: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser("coldstart", help="write successful tool-use demonstrations of a "
                                         "repository domain's train tasks (SFT data)")
    p.add_argument("--domain", default="repo", help="the [domain.<name>] to demonstrate")
    p.add_argument("--out", required=True, help="JSONL path of the rows")
    p.add_argument("--episodes", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=2, help="episodes run at once")
    common(p)


def run_coldstart(args: argparse.Namespace, config: Config) -> int:
    from streamrl.domains.agentic import ToolDomain
    from streamrl.domains.declared import DeclarationError, build_domain

    cfg = config.domain.get(args.domain)
    if cfg is None or not cfg.tools.enabled:
        print(f"streamrl coldstart: no [domain.{args.domain}] with tools.enabled in the config",
              file=sys.stderr)
        return 2
    try:
        domain = build_domain(args.domain, cfg)
    except DeclarationError as exc:
        print(f"streamrl coldstart: {exc}", file=sys.stderr)
        return 2
    if not isinstance(domain, ToolDomain):
        print(f"streamrl coldstart: domain {args.domain!r} is not worked with the tools",
              file=sys.stderr)
        return 2
    stats = trio.run(_write, args, config, domain)
    print(json.dumps({"out": args.out, **stats}))
    return 0 if stats["kept"] else 1


async def _write(args: argparse.Namespace, config: Config, domain: Any) -> dict[str, Any]:
    from streamrl.actors.executor import sandboxes_for
    from streamrl.domains.repo.coldstart import Budgets, write_coldstart
    from streamrl.models import load_tokenizer, model_limits

    cfg = config.domain[args.domain]
    tokenizer = load_tokenizer(model_limits(config.model.spec)[0])
    budgets = Budgets(max_turns=domain.episode.max_turns,
                      max_tool_calls=domain.episode.max_tool_calls,
                      max_new_tokens=cfg.max_new_tokens or config.scheduler.max_new_tokens,
                      max_total_tokens=domain.episode.max_total_tokens)
    async with sandboxes_for(config).opened() as sandboxes:
        stats = await write_coldstart(domain, sandboxes.session, Path(args.out),
                                      episodes=args.episodes, seed=args.seed,
                                      tokenizer=tokenizer, budgets=budgets,
                                      concurrency=args.concurrency)
    return stats.as_dict()
