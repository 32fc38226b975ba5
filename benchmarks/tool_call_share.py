"""Claim (issue 35): the share of model turns that hold a well-formed tool call on the
repository tasks, before the SFT cold start (about 1% for SmolLM2-135M) and after it (50% or
more is the goal). Run it on the base model, then on the SFT checkpoint, same arguments.

Episodes of the config's repository domain (``[domain.<name>]`` with ``tools.enabled``; the
held-out split by default) run turn by turn as the RL loop runs them, without the queues:
the domain's prompt (``render_prompt``: the system message, the tools in the model's
format), the in-process engine (the stop tokens every engine shares), the reply through the
domain's own ``act`` in a process sandbox session that starts with the item's repository,
the tool results (or the reminder, for a reply without a call) appended as the generator
appends them (``actors.episodes.observation_ids``), until ``finish``, ``--max-turns``, or
the token budget. The final check scores each episode.

Counted per model turn: ``with_call`` (the parser found at least one call), ``well_formed``
(it found one or more, and every one is a declared tool with JSON arguments that validate:
no error result from the parser), and the parser's most common errors. Per episode:
``finished`` (called finish) and the reward.
Simplifications: members run their turns in lock step (one batch per turn); the budgets are
the table's (``max_turns`` capped by ``--max-turns``, ``max_total_tokens``).

    .venv/bin/python benchmarks/tool_call_share.py --config configs/agentic.toml \\
        [--model smollm2-135m|DIR] [--split eval] [--items 4] [--samples 2] \\
        [--max-turns 4] [--max-new-tokens 256] [--temperature 0.7] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from streamrl.actors.episodes import observation_ids
from streamrl.actors.executor import sandboxes_for
from streamrl.config.schema import load_config
from streamrl.domains.agentic import ToolDomain
from streamrl.domains.declared import build_domain
from streamrl.inference.chat import tool_format
from streamrl.inference.transformers_engine import open_transformers_engine
from streamrl.models import load_tokenizer, resolve_model
from streamrl.protocol.messages import Sampling, Turn


@dataclass
class Member:
    item: Any
    session: Any
    ids: list[int] = field(default_factory=list)  # the context after the prompt
    turns: int = 0
    with_call: int = 0
    well_formed: int = 0
    finished: bool = False
    ended: bool = False
    errors: Counter[str] = field(default_factory=Counter)  # the parser's, by message
    reward: float = 0.0


async def take_turn(m: Member, c: Any, domain: ToolDomain, tokenizer: Any, fmt: str,
                    prompt: list[int], budget: int) -> None:
    """One reply of member ``m``: counted, acted on, its observation appended."""
    m.turns += 1
    parsed = domain.parse(c.text, fmt)  # type: ignore[arg-type]
    m.with_call += bool(parsed.calls)
    m.well_formed += bool(parsed.calls) and not any(call.error for call in parsed.calls)
    m.errors.update(call.error[:60] for call in parsed.calls if call.error)
    action = await domain.act(m.item, c.text, m.session, fmt)  # type: ignore[arg-type]
    m.ids += [int(t) for t in c.tokens]
    if action.done:
        m.finished = m.ended = True
        return
    turn = Turn(text=c.text, observation=action.observation, tools=action.results)
    obs = observation_ids(tokenizer, domain, turn, closed=c.finish_reason == "stop")
    m.ids += obs
    if budget and len(prompt) + len(m.ids) >= budget:
        m.ended = True


async def run(args: argparse.Namespace) -> dict[str, Any]:
    config = load_config(args.config, args.overrides)
    cfg = config.domain[args.domain]
    domain = build_domain(args.domain, cfg)
    assert isinstance(domain, ToolDomain), "the domain must have tools.enabled"
    model_dir = resolve_model(args.model or config.model.spec)
    tokenizer = load_tokenizer(model_dir)
    fmt = tool_format(tokenizer)
    items = domain.load_items(args.split)[:args.items]
    max_turns = min(args.max_turns, domain.episode.max_turns)
    budget = domain.episode.max_total_tokens
    sampling = Sampling(max_new_tokens=args.max_new_tokens or cfg.max_new_tokens
                        or config.scheduler.max_new_tokens,
                        temperature=args.temperature, seed=args.seed)
    start = time.monotonic()
    async with AsyncExitStack() as stack:
        engine = await stack.enter_async_context(open_transformers_engine(
            model_dir, max_batch=len(items) * args.samples, threads=args.threads))
        boxes = await stack.enter_async_context(sandboxes_for(config).opened())
        members = []
        for item in items:
            for k in range(args.samples):
                session = await stack.enter_async_context(
                    boxes.session(domain, f"share-{item.id}-{k}"))
                await session.put_files(domain.session_files(item))
                members.append(Member(item, session))
        prompts = {item.id: domain.render_prompt(item, tokenizer) for item in items}
        for _ in range(max_turns):
            live = [m for m in members if not m.ended]
            if not live:
                break
            completions = await engine.generate(
                [prompts[m.item.id] + m.ids for m in live], sampling)
            async with trio.open_nursery() as nursery:
                for m, c in zip(live, completions, strict=True):
                    nursery.start_soon(take_turn, m, c, domain, tokenizer, fmt,
                                       prompts[m.item.id], budget)
        for m in members:
            result = await m.session.run(domain.final_request(m.item))
            m.reward = domain.score(m.item, "", result)
    turns = sum(m.turns for m in members)
    return {
        "model": str(args.model or config.model.spec), "domain": args.domain,
        "split": args.split, "items": len(items), "samples": args.samples,
        "max_turns": max_turns, "max_new_tokens": sampling.max_new_tokens,
        "temperature": args.temperature, "tool_format": fmt, "turns": turns,
        "with_call": sum(m.with_call for m in members),
        "well_formed": sum(m.well_formed for m in members),
        "share_well_formed": round(sum(m.well_formed for m in members) / max(turns, 1), 4),
        "episodes": len(members), "finished": sum(m.finished for m in members),
        "reward_mean": round(sum(m.reward for m in members) / max(len(members), 1), 4),
        "call_errors": dict(sum((m.errors for m in members), Counter()).most_common(5)),
        "wall_s": round(time.monotonic() - start, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/agentic.toml")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--domain", default="repo")
    p.add_argument("--model", default="", help="a model spec or a checkpoint directory "
                                               "(default: the config's model.spec)")
    p.add_argument("--split", default="eval", choices=["train", "eval"])
    p.add_argument("--items", type=int, default=4)
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", help="also write the result here")
    args = p.parse_args()
    out = trio.run(run, args)
    print(json.dumps(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    sys.exit(0)


if __name__ == "__main__":
    main()
