"""A tool-use cold start: successful demonstrations of a repository domain's train tasks,
worked with the standard tools, written as an SFT data set in OpenAI chat format.

    streamrl coldstart --config configs/agentic.toml --domain repo --out runs/coldstart.jsonl \\
        [--episodes 200] [--seed 0] [--concurrency 2]

Every episode takes a train item of the domain (round robin over its train split, shuffled by
the seed), draws a demonstration (:mod:`.demos`: read, reproduce, patch, run the tests,
finish; sometimes a mistake first and the recovery from what the tools answered) and runs it
turn by turn the way an RL episode runs: the assistant's text in the model's tool format goes
through the domain's own ``act`` (the RL-time parser and :class:`StandardTools`) in a
sandbox session opened as the executor opens one, starting with the same files. When the
demonstration finishes, the domain's final check judges the work dir.

A row is ``{"id", "messages": [...], "tools": [...]}`` in the SFT loader's chat format
(learner/sft_data.py, docs/learner.md): the domain's system and user messages, then
``assistant`` messages (``content``: the turn's prose; ``tool_calls``: ``{"id", "type":
"function", "function": {"name", "arguments": {...}}}``) each followed by one ``tool``
message per call (``tool_call_id``, ``name``, ``content``); it ends with the assistant's
``finish`` call (the model never sees that call's result). ``tools`` holds the standard
tools' specs; ``id`` is ``<item id>/<episode>``.

Guarantees:
- train split only: items come from ``load_items("train")``; the held-out split is never read;
- every tool message is what the standard tools answered in the sandbox for that call;
- a row is written only when the domain's final check scores it 1.0 (the hidden
  ``FAIL_TO_PASS`` and ``PASS_TO_PASS`` tests), the demonstration ran to its ``finish``, the
  parser read back exactly the calls the turn made, and it fits the RL episode's budgets
  (``max_turns``, ``max_tool_calls``, and with a tokenizer ``max_new_tokens`` /
  ``max_total_tokens``, counted on the tokens the SFT loader trains); everything else is
  counted, by reason, in :class:`Statistics`;
- a row is what the model sees at RL time: the SFT loader (``render_chat``) renders it into
  the tokens the generator puts together for the same episode (``prompt_ids``: the tool block
  in the system message where the template renders no tools, as for SmolLM2; each reply as
  the model writes it, its prose then one ``<tool_call>`` block a call, :func:`reply_text`,
  and its end-of-turn token; ``tool_results_ids`` after it). tests/domains/test_coldstart.py
  checks it token for token on SmolLM2's template;
- deterministic: the same domain, seed and episode count write the same rows, up to what the
  tools' output varies by from run to run (pytest prints objects' addresses in a traceback).

Not covered: models whose tool format is not hermes (llama3's one-JSON-object reply cannot
hold the prose and several calls of a turn; mistral's is refused by the tool domains).
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from itertools import groupby
from pathlib import Path
from typing import Any

import trio

from streamrl.domains.agentic import DEFAULT_SYSTEM, ToolDomain
from streamrl.domains.repo.demos import (
    Abandon,
    Call,
    Step,
    choose_plan,
    demonstration,
    task_facts,
)
from streamrl.domains.template import chat_messages
from streamrl.inference.chat import tool_format
from streamrl.learner.sft_data import render_chat
from streamrl.protocol.messages import ToolReply
from streamrl.sandbox.base import SandboxSession

MISTAKES = 0.4
"""The share of demonstrations that make a mistake first and recover from it."""

OpenSession = Callable[[Any, str, str], AbstractAsyncContextManager[SandboxSession]]
"""``(domain, label, item image) -> session``: the executor's ``Sandboxes.session``."""


@dataclass
class Budgets:
    """The RL episode's limits a demonstration must fit (0: not checked)."""

    max_turns: int
    max_tool_calls: int = 0
    max_new_tokens: int = 0
    max_total_tokens: int = 0


@dataclass
class Statistics:
    """What a cold start wrote: kept rows, drops by reason, their mistakes, turns, sizes."""

    episodes: int = 0
    kept: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    mistakes: Counter[str] = field(default_factory=Counter)
    turns: Counter[int] = field(default_factory=Counter)
    items: set[str] = field(default_factory=set)
    longest_turn_tokens: int = 0
    longest_episode_tokens: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"episodes": self.episodes, "kept": self.kept, "dropped": dict(self.dropped),
                "mistakes": dict(self.mistakes),
                "turns": dict(sorted(self.turns.items())), "train_items": len(self.items),
                "longest_turn_tokens": self.longest_turn_tokens,
                "longest_episode_tokens": self.longest_episode_tokens}


# --------------------------------------------------------------------------- rendering


def reply_text(step: Step) -> str:
    """The assistant's reply as the model writes it at RL time (hermes): its prose, then one
    ``<tool_call>`` block per call, as the tools prompt shows them."""
    blocks = ["<tool_call>\n" + json.dumps({"name": c.name, "arguments": c.arguments},
                                           ensure_ascii=False) + "\n</tool_call>"
              for c in step.calls]
    return "\n".join([step.content, *blocks] if step.content else blocks)


def turn_messages(step: Step, results: Sequence[ToolReply], last: bool
                  ) -> list[dict[str, Any]]:  # fmt: skip
    """One turn: the assistant message, then its calls' results (none after the last)."""
    calls = [{"id": f"call_{i}", "type": "function",
              "function": {"name": c.name, "arguments": c.arguments}}
             for i, c in enumerate(step.calls)]
    out: list[dict[str, Any]] = [{"role": "assistant", "content": step.content,
                                  "tool_calls": calls}]
    if not last:
        out += [{"role": "tool", "tool_call_id": r.call_id, "name": r.name, "content": r.content}
                for r in results]
    return out


def step_of(message: dict[str, Any]) -> Step:
    """The turn an assistant message of a row holds."""
    return Step(message.get("content") or "", tuple(
        Call(c["function"]["name"], c["function"]["arguments"])
        for c in message.get("tool_calls") or ()))


def token_budget_problem(tokenizer: Any, row: dict[str, Any], budgets: Budgets,
                         stats: Statistics) -> str:
    """Why the SFT loader would refuse the row, or the generator's token budgets would cut
    its episode ("" if neither), counted on the tokens the loader makes of it."""
    try:
        prompt, tokens, mask = render_chat(tokenizer, row["messages"], row["tools"])
    except ValueError as exc:
        return f"the SFT loader refuses it: {exc}"
    longest = max(len(list(run)) for bit, run in groupby(mask) if bit)
    total = len(prompt) + len(tokens)
    stats.longest_turn_tokens = max(stats.longest_turn_tokens, longest)
    stats.longest_episode_tokens = max(stats.longest_episode_tokens, total)
    if budgets.max_new_tokens and longest > budgets.max_new_tokens:
        return f"a reply of more than max_new_tokens ({budgets.max_new_tokens}) tokens"
    if budgets.max_total_tokens and total > budgets.max_total_tokens:
        return f"more than max_total_tokens ({budgets.max_total_tokens}) tokens"
    return ""


# --------------------------------------------------------------------------- episodes


@dataclass
class Outcome:
    """One episode: its row, or why it was dropped."""

    row: dict[str, Any] | None
    dropped: str = ""
    mistake: str = ""
    turns: int = 0


async def demonstrate(domain: ToolDomain, item: Any, open_session: OpenSession,
                      rng: random.Random, budgets: Budgets, mistakes: float = MISTAKES
                      ) -> Outcome:  # fmt: skip
    """Run one demonstration of ``item`` in a fresh session and judge it (see the module
    docstring); ``mistakes``: how often it makes a mistake first. Raises only what the
    sandbox raises."""
    try:
        facts = task_facts(item)
        plan = choose_plan(facts, rng, budgets.max_turns, budgets.max_tool_calls, mistakes)
    except ValueError as exc:
        return Outcome(None, f"not demonstrable: {exc}")
    script = demonstration(facts, plan, rng)
    messages: list[dict[str, Any]] = chat_messages(domain.cfg.prompt, item,
                                                   domain.opts.system or DEFAULT_SYSTEM)
    files = {**getattr(domain.sandbox, "files", {}), **domain.session_files(item)}
    async with open_session(domain, f"coldstart-{item.id}", domain.item_image(item)) as session:
        await session.put_files(files)
        step, turns = next(script), 0
        while True:
            action = await domain.act(item, reply_text(step), session, "hermes")
            turns += 1
            if [r.name for r in action.results] != [c.name for c in step.calls]:
                return Outcome(None, "the parser read other calls than the turn made")
            messages += turn_messages(step, action.results, last=action.done)
            if action.done:
                break
            try:
                step = script.send(action.results)
            except Abandon as exc:
                return Outcome(None, str(exc), plan.mistake)
            except StopIteration:
                return Outcome(None, "the demonstration ended without finish", plan.mistake)
        check = domain.final_request(item)
        result = await session.run(check) if check else None
    if domain.score(item, "", result) != 1.0:
        return Outcome(None, "the final check did not pass", plan.mistake)
    row = {"messages": messages, "tools": [t.spec() for t in domain.tools]}
    return Outcome(row, mistake=plan.mistake, turns=turns)


async def write_coldstart(domain: ToolDomain, open_session: OpenSession, out: Path, *,
                          episodes: int, seed: int = 0, tokenizer: Any = None,
                          budgets: Budgets | None = None, concurrency: int = 2,
                          mistakes: float = MISTAKES) -> Statistics:
    """``episodes`` demonstrations over the domain's train items, the successful ones
    written to ``out`` (JSONL, in episode order). ``tokenizer``: the model's, to check its
    tool format and the token budgets (without one, neither is checked)."""
    if tokenizer is not None and tool_format(tokenizer) != "hermes":
        raise ValueError(f"the model writes tool calls in the {tool_format(tokenizer)} format; "
                         f"the cold start writes hermes-format demonstrations")
    budgets = budgets or Budgets(max_turns=domain.episode.max_turns,
                                 max_tool_calls=domain.episode.max_tool_calls)
    items = sorted(domain.load_items("train"), key=lambda it: it.id)
    if not items:
        raise ValueError(f"domain {domain.name!r} has no train items")
    random.Random(seed).shuffle(items)
    outcomes: list[Outcome | None] = [None] * episodes
    limiter = trio.CapacityLimiter(concurrency)

    async def one(i: int) -> None:
        item = items[i % len(items)]
        async with limiter:
            outcomes[i] = await demonstrate(domain, item, open_session,
                                            random.Random(f"{seed}/{i}/{item.id}"), budgets,
                                            mistakes)

    async with trio.open_nursery() as nursery:
        for i in range(episodes):
            nursery.start_soon(one, i)
    stats = Statistics(episodes=episodes)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as fh:
        for i, o in enumerate(outcomes):
            assert o is not None
            if o.row is not None and tokenizer is not None:
                o.dropped = token_budget_problem(tokenizer, o.row, budgets, stats)
            if o.row is None or o.dropped:
                stats.dropped[o.dropped] += 1
                continue
            stats.kept += 1
            stats.mistakes[o.mistake or "none"] += 1
            stats.turns[o.turns] += 1
            item_id = items[i % len(items)].id
            stats.items.add(item_id)
            fh.write(json.dumps({"id": f"{item_id}/{i}", **o.row}, ensure_ascii=False) + "\n")
    return stats
