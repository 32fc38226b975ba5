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

A row is ``{"messages": [...], "tools": [...]}``: the domain's system and user messages, then
``assistant`` messages (``content`` and ``tool_calls``: ``{"id", "type": "function",
"function": {"name", "arguments": {...}}}``) each followed by one ``tool`` message per call
(``tool_call_id``, ``name``, ``content``); it ends with the assistant's ``finish`` call (the
model never sees that call's result). ``tools`` holds the standard tools' specs.

Guarantees:
- train split only: items come from ``load_items("train")``; the held-out split is never read;
- every tool message is what the standard tools answered in the sandbox for that call;
- a row is written only when the domain's final check scores it 1.0 (the hidden
  ``FAIL_TO_PASS`` and ``PASS_TO_PASS`` tests), the demonstration ran to its ``finish``, the
  parser read back exactly the calls the turn made, and it fits the RL episode's budgets
  (``max_turns``, ``max_tool_calls``, and with ``max_new_tokens`` / ``max_total_tokens`` the
  generator's token budgets); everything else is counted, by reason, in :class:`Statistics`;
- a row is what the model sees at RL time: rendered with the model's chat template (with
  ``tools=`` where the template renders tools), its tokens are the ones the generator puts
  together for the same turns (``prompt_ids``, the replies, ``tool_results_ids``): where the
  template renders no tools (SmolLM2), the system message already holds the hermes-style tool
  block ``prompt_ids`` adds and each assistant ``content`` is the reply's text with its
  ``<tool_call>`` blocks (``tool_calls`` says the same calls, for readers of the format);
  where it renders them, ``content`` is the prose alone and the template writes the calls
  (:func:`render_row` builds the RL-time tokens; tests/domains/test_coldstart.py checks both);
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
from streamrl.inference.chat import (
    Tool,
    ToolResult,
    supports_tools,
    tool_format,
    tool_results_ids,
    tools_system_prompt,
)
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


def prompt_messages(domain: ToolDomain, item: Any, native: bool) -> list[dict[str, Any]]:
    """The episode's first messages as ``prompt_ids`` renders them: the domain's
    conversation, with the tool block in the system message where the template renders no
    tools (``native`` False)."""
    messages: list[dict[str, Any]] = chat_messages(domain.cfg.prompt, item,
                                                   domain.opts.system or DEFAULT_SYSTEM)
    if native:
        return messages
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": tools_system_prompt(
            domain.tools, messages[0]["content"])}, *messages[1:]]
    return [{"role": "system", "content": tools_system_prompt(domain.tools)}, *messages]


def turn_messages(step: Step, results: Sequence[ToolReply], native: bool,
                  last: bool) -> list[dict[str, Any]]:
    """One turn: the assistant message, then its calls' results (none after the last)."""
    calls = [{"id": f"call_{i}", "type": "function",
              "function": {"name": c.name, "arguments": c.arguments}}
             for i, c in enumerate(step.calls)]
    content = step.content if native else reply_text(step)
    out: list[dict[str, Any]] = [{"role": "assistant", "content": content, "tool_calls": calls}]
    if not last:
        out += [{"role": "tool", "tool_call_id": r.call_id, "name": r.name, "content": r.content}
                for r in results]
    return out


def _ids(tokenizer: Any, messages: list[dict[str, Any]], **kw: Any) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tokenize=True, **kw)
    if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding by default
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def render_row(tokenizer: Any, row: dict[str, Any]) -> tuple[list[int], list[int]]:
    """The row's tokens as the RL generator puts them together, and the loss mask (1 on
    the assistant's tokens, its end-of-turn token included): the prompt through the
    template, each reply's text and the EOS it stops at, each turn's results through
    ``tool_results_ids``. Hermes rows only (see the module docstring)."""
    messages, native = row["messages"], supports_tools(tokenizer)
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    extra = {"tools": row["tools"]} if native else {}
    ids = _ids(tokenizer, messages[:first], add_generation_prompt=True, **extra)
    mask = [0] * len(ids)
    tools = [Tool.from_spec(spec) for spec in row["tools"]] if native else []
    i = first
    while i < len(messages):
        m = messages[i]
        text = reply_text(_step(m)) if native else m["content"]
        reply = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids, mask = ids + reply, mask + [1] * len(reply)
        i += 1
        results = []
        while i < len(messages) and messages[i]["role"] == "tool":
            t = messages[i]
            results.append(ToolResult(call_id=t["tool_call_id"], name=t["name"],
                                      content=t["content"]))
            i += 1
        if results:
            obs = tool_results_ids(tokenizer, results, closed=True, tools=tools)
            ids, mask = ids + obs, mask + [0] * len(obs)
    return [int(x) for x in ids], mask


def _step(message: dict[str, Any]) -> Step:
    return Step(message.get("content") or "", tuple(
        Call(c["function"]["name"], c["function"]["arguments"])
        for c in message.get("tool_calls") or ()))


def token_budget_problem(tokenizer: Any, row: dict[str, Any], budgets: Budgets,
                         stats: Statistics) -> str:
    """Why the row would not fit the generator's token budgets ("" if it fits)."""
    ids, mask = render_row(tokenizer, row)
    spans, start = [], None
    for pos, bit in enumerate([*mask, 0]):
        if bit and start is None:
            start = pos
        elif not bit and start is not None:
            spans.append((start, pos))
            start = None
    longest = max(end - begin for begin, end in spans)
    stats.longest_turn_tokens = max(stats.longest_turn_tokens, longest)
    stats.longest_episode_tokens = max(stats.longest_episode_tokens, len(ids))
    if budgets.max_new_tokens and longest > budgets.max_new_tokens:
        return f"a reply of more than max_new_tokens ({budgets.max_new_tokens}) tokens"
    if budgets.max_total_tokens and len(ids) > budgets.max_total_tokens:
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
                      rng: random.Random, native: bool, budgets: Budgets,
                      mistakes: float = MISTAKES) -> Outcome:
    """Run one demonstration of ``item`` in a fresh session and judge it (see the module
    docstring); ``mistakes``: how often it makes a mistake first. Raises only what the
    sandbox raises."""
    try:
        facts = task_facts(item)
        plan = choose_plan(facts, rng, budgets.max_turns, budgets.max_tool_calls, mistakes)
    except ValueError as exc:
        return Outcome(None, f"not demonstrable: {exc}")
    script = demonstration(facts, plan, rng)
    messages = prompt_messages(domain, item, native)
    files = {**getattr(domain.sandbox, "files", {}), **domain.session_files(item)}
    async with open_session(domain, f"coldstart-{item.id}", domain.item_image(item)) as session:
        await session.put_files(files)
        step, turns = next(script), 0
        while True:
            action = await domain.act(item, reply_text(step), session, "hermes")
            turns += 1
            if [r.name for r in action.results] != [c.name for c in step.calls]:
                return Outcome(None, "the parser read other calls than the turn made")
            messages += turn_messages(step, action.results, native, last=action.done)
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
    written to ``out`` (JSONL, in episode order). ``tokenizer``: the model's (its template
    decides the rows' form; without one, the fallback form of templates without tools,
    and no token budget is checked)."""
    if tokenizer is not None and tool_format(tokenizer) != "hermes":
        raise ValueError(f"the model writes tool calls in the {tool_format(tokenizer)} format; "
                         f"the cold start writes hermes-format demonstrations")
    budgets = budgets or Budgets(max_turns=domain.episode.max_turns,
                                 max_tool_calls=domain.episode.max_tool_calls)
    native = tokenizer is not None and supports_tools(tokenizer)
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
                                            random.Random(f"{seed}/{i}/{item.id}"), native,
                                            budgets, mistakes)

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
            stats.items.add(items[i % len(items)].id)
            fh.write(json.dumps(o.row, ensure_ascii=False) + "\n")
    return stats
