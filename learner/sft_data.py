"""Supervised fine-tuning data: rows of a declared data set rendered, with the model's own chat
template, into the token layout of an RL episode, and the order the learner trains them in.

A data set is a ``.jsonl`` (gzip-compressed or not) or ``.parquet`` file, a directory of them,
or a ``datasets`` data set saved with ``save_to_disk`` (:func:`domains.declared.read_rows`).
Each row is one of:

- a *chat row*, OpenAI's chat format: ``{"messages": [...], "tools": [...]}``; a message is
  ``{"role": "system" | "user" | "assistant" | "tool", "content": str, "tool_calls":
  [{"type": "function", "function": {"name": str, "arguments": {...} or a JSON string}}],
  "tool_call_id": str}``; ``tools`` (optional) are JSON-schema function specs
  (``{"type": "function", "function": {"name", "description", "parameters"}}``; in a
  columnar file, where every row's schemas would have to share one type, ``tools`` and
  ``arguments`` may be JSON text);
- a *token row*: ``{"prompt_ids": [int], "completion_ids": [int], "mask": [0|1]}`` (mask
  optional: all 1), the exact tokens a policy sampled (``streamrl replay export --sft``).

Guarantees:
- a chat row's tokens are the ones an RL episode of the same conversation has: the prompt is
  the template's rendering of the messages before the first assistant message, tools declared
  the way :func:`inference.chat.prompt_ids` declares them (the template's ``tools=``, or the
  hermes system prompt where the template renders no tools, the assistant's calls then
  written as ``<tool_call>`` blocks); every assistant turn is its text and the end-of-turn
  token, mask 1; whatever the template puts between turns (tool results, user messages,
  headers) is mask 0; each piece is tokenized on its own, as the episode's pieces are;
- the tokens decode back to the template's rendering of the whole conversation (up to the
  end of the last assistant turn), every rendering of the conversation so far is a prefix of
  the whole one, and each assistant turn's tool calls parse back from its text
  (:func:`inference.chat.parse_tool_calls`, in the model's format) to the row's calls. A row
  that fails any of these, does not fit ``max_tokens``, or has an id outside the vocabulary
  is refused with :class:`RowError`, which names the row (its file and index);
- the order: position ``p`` of the training stream is example ``perm(epoch)[p mod n]`` with
  ``epoch = p // n`` and one seeded permutation per epoch, a function of the seed and the
  examples only, so every rank and every restart computes the same examples for the same
  positions. An example trained at position ``p`` has the id :meth:`SFTData.example_id`;
  the learner finds the next position in its ledger (:func:`next_position`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from streamrl.domains.declared import DeclarationError, data_path, read_rows
from streamrl.inference.chat import (
    Tool,
    parse_tool_calls,
    supports_tools,
    tool_format,
    tools_system_prompt,
)
from streamrl.protocol.messages import (
    MAX_NEW_TOKENS,
    Rollout,
    Sample,
    Sampling,
    Task,
    Trajectory,
    floats_to_bytes,
    ids_to_bytes,
    now,
)

SFT_DOMAIN = "sft"
"""The domain name of a supervised example's task (metrics, the ledger's ids)."""
ROLES = ("system", "user", "assistant", "tool")
_TURN_MARK = "\x00streamrl-sft-turn\x00"


class RowError(ValueError):
    """A row that cannot be a supervised example; the message names the row."""


@dataclass(frozen=True)
class Example:
    """One supervised example: ``prompt_ids`` then ``tokens``, ``mask`` 1 on trained tokens."""

    id: str
    prompt_ids: list[int]
    tokens: list[int]
    mask: list[int]


# --------------------------------------------------------------------------- chat rows


def _arguments(raw: Any, where: str) -> dict[str, Any]:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError as exc:
            raise ValueError(f"{where}: arguments are not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: arguments must be a JSON object")
    return raw


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(f'{where}: a tool call is {{"type": "function", "function": '
                         f'{{"name": ..., "arguments": ...}}}}')
    out = {"type": "function",
           "function": {"name": fn["name"], "arguments": _arguments(fn.get("arguments"), where)}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def normal_messages(messages: Any) -> list[dict[str, Any]]:
    """The row's messages as the template takes them: absent fields dropped (Parquet fills
    them with None), roles and contents checked, tool-call arguments as objects."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    out = []
    for k, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"message {k}: not an object")
        m = {key: v for key, v in m.items() if v is not None}
        if m.get("role") not in ROLES:
            raise ValueError(f"message {k}: role {m.get('role')!r} (one of {', '.join(ROLES)})")
        m["content"] = m.get("content", "")
        if not isinstance(m["content"], str):
            raise ValueError(f"message {k}: content must be a string")
        calls = m.pop("tool_calls", None) or []
        if calls and m["role"] != "assistant":
            raise ValueError(f"message {k}: only assistant messages make tool calls")
        if not isinstance(calls, list):
            raise ValueError(f"message {k}: tool_calls must be a list")
        if calls:
            m["tool_calls"] = [_tool_call(c, f"message {k}") for c in calls]
        out.append(m)
    return out


def hermes_calls(content: str, calls: Sequence[dict[str, Any]]) -> str:
    """An assistant turn's text with its calls as hermes ``<tool_call>`` blocks (the format
    the fallback system prompt asks for and :func:`inference.chat.parse_tool_calls` reads)."""
    blocks = [
        "<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                      "arguments": c["function"]["arguments"]},
                                     ensure_ascii=False) + "\n</tool_call>"
        for c in calls
    ]  # fmt: skip
    return "\n".join([content, *blocks] if content else blocks)


def _for_template(tokenizer: Any, messages: list[dict[str, Any]], tools: list[Tool]
                  ) -> tuple[list[dict[str, Any]], dict[str, Any]]:  # fmt: skip
    """``(messages, apply_chat_template kwargs)``: the template's own tools where it renders
    them, else (as :func:`inference.chat.prompt_ids`) the tools in the first system message
    and each call written out in the assistant's text."""
    if supports_tools(tokenizer):
        return messages, ({"tools": [t.spec() for t in tools]} if tools else {})
    out = []
    for m in messages:
        if calls := m.get("tool_calls"):
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = hermes_calls(m["content"], calls)
        out.append(m)
    if tools:
        if out[0]["role"] == "system":
            out[0] = {**out[0], "content": tools_system_prompt(tools, out[0]["content"])}
        else:
            out.insert(0, {"role": "system", "content": tools_system_prompt(tools)})
    return out, {}


def _tool_role_as_user(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each run of ``tool`` messages as one user message of ``<tool_response>`` blocks, as
    :func:`inference.chat.tool_results_ids` sends them to a template that refuses the role."""
    out: list[dict[str, Any]] = []
    for m in messages:
        block = f"<tool_response>\n{m['content']}\n</tool_response>"
        if m["role"] != "tool":
            out.append(m)
        elif out and out[-1].get("_tools"):
            out[-1]["content"] += "\n" + block
        else:
            out.append({"role": "user", "content": block, "_tools": True})
    return [{k: v for k, v in m.items() if k != "_tools"} for m in out]


class _Renderer:
    """The template's renderings of a conversation's prefixes."""

    def __init__(self, tokenizer: Any, messages: list[dict[str, Any]], extra: dict[str, Any]):
        self.tokenizer, self.messages, self.extra = tokenizer, messages, extra
        try:
            self.text(len(messages), False)
        except Exception:  # the template refuses the tool role (raise_exception in jinja)
            if not any(m["role"] == "tool" for m in messages):
                raise
            self.messages = _tool_role_as_user(messages)

    def text(self, k: int, generation_prompt: bool) -> str:
        return str(self.tokenizer.apply_chat_template(
            self.messages[:k], tokenize=False, add_generation_prompt=generation_prompt,
            **self.extra))  # fmt: skip

    def closing(self) -> str:
        """What the template writes after an assistant message's text (its end of turn)."""
        convo = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _TURN_MARK}]
        rendered = str(self.tokenizer.apply_chat_template(convo, tokenize=False, **self.extra))
        return rendered[rendered.index(_TURN_MARK) + len(_TURN_MARK):]


def _check_calls(turn: int, text: str, calls: list[dict[str, Any]], tools: list[Tool],
                 tokenizer: Any) -> None:  # fmt: skip
    """The calls parsed back from an assistant turn's rendered ``text`` are the row's."""
    names = {t.name for t in tools}
    declared = tools + [Tool(name=c["function"]["name"], description="")
                        for c in calls if c["function"]["name"] not in names]
    reply = parse_tool_calls(text, declared, tool_format(tokenizer))
    errors = [c.error for c in reply.calls if c.error]
    got = [(c.name, c.arguments) for c in reply.calls]
    want = [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    if errors or (calls and got != want):
        why = "; ".join(errors) or f"parsed {got}, the row has {want}"
        raise ValueError(f"assistant turn {turn}: its tool calls do not parse back from its "
                         f"rendered text ({why[:300]})")


def _assistant_spans(r: _Renderer, tools: list[Tool], calls: list[list[dict[str, Any]]]
                     ) -> tuple[str, list[tuple[int, int]]]:  # fmt: skip
    """``(whole text, [(start, end)] of each assistant turn's trained characters)``: its
    text and the end-of-turn token (the closing's end-of-sequence token, else the closing)."""
    roles = [m["role"] for m in r.messages]
    turns = [k for k, role in enumerate(roles) if role == "assistant"]
    if not turns:
        raise ValueError("no assistant message: nothing to train on")
    if turns[0] == 0:
        raise ValueError("the first message is the assistant's: no prompt before it")
    whole = r.text(len(r.messages), False)
    closing = r.closing()
    eos = getattr(r.tokenizer, "eos_token", None) or ""
    stop = eos if eos and closing.startswith(eos) else closing
    spans = []
    for n, k in enumerate(turns):
        head, done = r.text(k, True), r.text(k + 1, False)
        if not (done.startswith(head) and whole.startswith(done)):
            raise ValueError(f"assistant turn {n + 1}: the template renders the conversation "
                             "up to it differently from the whole conversation (not a prefix)")
        turn = done[len(head):]
        if not closing or not turn.endswith(closing):
            raise ValueError(f"assistant turn {n + 1}: the template does not end it with its "
                             f"end of turn {closing!r}")
        text = turn[: len(turn) - len(closing)]
        _check_calls(n + 1, text, calls[n], tools, r.tokenizer)
        spans.append((len(head), len(head) + len(text) + len(stop)))
    return whole, spans


def _encode(tokenizer: Any, text: str) -> list[int]:
    ids = [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
    back = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    if back != text:
        raise ValueError(f"the tokens do not decode back to the rendered text: {text[:80]!r} "
                         f"-> {back[:80]!r}")
    return ids


def render_chat(tokenizer: Any, messages: Any, tools: Any = None) -> tuple[list[int], list[int],
                                                                           list[int]]:  # fmt: skip
    """``(prompt_ids, tokens, mask)`` of one chat row (see the module); raises ``ValueError``
    with the reason a row cannot be rendered."""
    msgs = normal_messages(messages)
    if isinstance(tools, str):  # a column of JSON text (Parquet: the schemas differ per tool)
        try:
            tools = json.loads(tools)
        except ValueError as exc:
            raise ValueError(f"tools are not JSON: {exc}") from None
    if tools is not None and not isinstance(tools, list):
        raise ValueError("tools must be a list of function specs")
    declared = [Tool.from_spec(t) for t in tools or []]
    if tool_format(tokenizer) == "mistral" and any(m.get("tool_calls") for m in msgs):
        raise ValueError("this model writes tool calls after the special token [TOOL_CALLS]; "
                         "tool calls are rendered for the hermes and llama3 formats")
    calls = [m.get("tool_calls", []) for m in msgs if m["role"] == "assistant"]
    templated, extra = _for_template(tokenizer, msgs, declared)
    whole, spans = _assistant_spans(_Renderer(tokenizer, templated, extra), declared, calls)
    prompt = _encode(tokenizer, whole[: spans[0][0]])
    tokens: list[int] = []
    mask: list[int] = []
    at = spans[0][0]
    for start, end in spans:
        between = _encode(tokenizer, whole[at:start]) if start > at else []
        turn = _encode(tokenizer, whole[start:end])
        tokens += between + turn
        mask += [0] * len(between) + [1] * len(turn)
        at = end
    return prompt, tokens, mask


# --------------------------------------------------------------------------- token rows


def _ids(row: dict[str, Any], key: str) -> list[int]:
    value = row.get(key)
    if not isinstance(value, list) or not all(isinstance(i, int) for i in value):
        raise ValueError(f"{key} must be a list of integers")
    return [int(i) for i in value]


def token_row(row: dict[str, Any]) -> tuple[list[int], list[int], list[int]]:
    """``(prompt_ids, tokens, mask)`` of a token row (mask absent: every token trained)."""
    prompt, tokens = _ids(row, "prompt_ids"), _ids(row, "completion_ids")
    mask = _ids(row, "mask") if row.get("mask") is not None else [1] * len(tokens)
    if len(mask) != len(tokens):
        raise ValueError(f"{len(tokens)} completion ids, {len(mask)} mask entries")
    if set(mask) - {0, 1}:
        raise ValueError("mask entries are 0 or 1")
    return prompt, tokens, mask


# --------------------------------------------------------------------------- the data set


def example(tokenizer: Any, row: dict[str, Any], row_id: str, vocab: int, max_tokens: int
            ) -> Example:  # fmt: skip
    """The example of one row; raises ``ValueError`` with why it is none."""
    if "messages" in row and row["messages"] is not None:
        prompt, tokens, mask = render_chat(tokenizer, row["messages"], row.get("tools"))
    elif "prompt_ids" in row:
        prompt, tokens, mask = token_row(row)
    else:
        raise ValueError("neither messages (a chat row) nor prompt_ids (a token row)")
    if not prompt:
        raise ValueError("empty prompt")
    if not any(mask):
        raise ValueError("no token to train on")
    if max_tokens and len(prompt) + len(tokens) > max_tokens:
        raise ValueError(f"{len(prompt) + len(tokens)} tokens, more than {max_tokens}")
    if vocab and any(not 0 <= i < vocab for i in prompt + tokens):
        raise ValueError(f"a token id outside the model's vocabulary [0, {vocab})")
    return Example(row_id, prompt, tokens, mask)


class SFTData:
    """The examples of a data set, in file order, and how the learner takes them."""

    def __init__(self, examples: list[Example], seed: int = 0,
                 refused: list[str] | None = None) -> None:  # fmt: skip
        if not examples:
            raise RowError("no example in the SFT data set")
        self.examples = examples
        self.seed = seed
        self.refused = refused or []
        """Why each row left out was refused (``skip_bad_rows``)."""
        h = hashlib.blake2b(str(seed).encode(), digest_size=6)
        for e in examples:
            h.update(np.asarray([len(e.prompt_ids), len(e.tokens)], dtype="<i8").tobytes())
            h.update(ids_to_bytes(e.prompt_ids) + ids_to_bytes(e.tokens) + bytes(e.mask))
        self.fingerprint = h.hexdigest()
        """12 hex digits of the examples' tokens, masks and the seed: the order's identity."""
        self._orders: dict[int, np.ndarray] = {}

    def example_at(self, position: int) -> Example:
        """The example trained at ``position`` (see the module: one permutation per epoch)."""
        epoch, index = divmod(position, len(self.examples))
        if epoch not in self._orders:
            rng = np.random.default_rng([self.seed % 2**63, epoch])
            self._orders = {epoch: rng.permutation(len(self.examples))}  # the current one
        return self.examples[int(self._orders[epoch][index])]

    def example_id(self, position: int) -> str:
        return f"{SFT_DOMAIN}-{self.fingerprint}-{position}"

    def trajectories(self, start: int, n: int, version: int) -> list[Trajectory]:
        """Positions ``start .. start + n - 1`` as one-sample groups the trainer takes with
        ``mode="sft"``, stamped with policy ``version``."""
        return [as_trajectory(self.example_at(p), self.example_id(p), version)
                for p in range(start, start + n)]


def as_trajectory(ex: Example, id: str, version: int) -> Trajectory:
    """An example as the learner's unit of work: a group of one sample whose completion is
    the example's tokens (mask: its trained ones), temperature 1, no reward."""
    created = now()
    task = Task(id=id, created_at=created, policy_version=version, domain=SFT_DOMAIN,
                item_id=ex.id, split="train", prompt="", spec={}, group_size=1,
                sampling=Sampling(max_new_tokens=min(max(len(ex.tokens), 1), MAX_NEW_TOKENS),
                                  temperature=1.0))  # fmt: skip
    sample = Sample(tokens=ids_to_bytes(ex.tokens),
                    logprobs=floats_to_bytes(np.zeros(len(ex.tokens), np.float32)), text="",
                    finish_reason="stop", weight_version=version, mask=bytes(ex.mask))
    rollout = Rollout(id=id, created_at=created, policy_version=version, task=task,
                      prompt_ids=ids_to_bytes(ex.prompt_ids), samples=[sample])
    return Trajectory(id=id, created_at=created, policy_version=version, rollout=rollout,
                      outcomes=[], rewards=[0.0])


def _row_id(where: str, index: int, row: dict[str, Any]) -> str:
    rid = row.get("id")
    return str(rid) if isinstance(rid, (str, int)) and not isinstance(rid, bool) else (
        f"{where}:{index}")


def load_sft_data(data: str, tokenizer: Any, *, vocab: int = 0, max_tokens: int = 0,
                  split: str = "", seed: int = 0, skip_bad_rows: bool = False) -> SFTData:
    """Every row of ``data`` (see the module) as an example. A row that is none raises
    :class:`RowError` naming it (file and index), or with ``skip_bad_rows`` is left out and
    its reason kept in :attr:`SFTData.refused`."""
    try:
        rows = read_rows(data_path(data), split or None)
    except DeclarationError as exc:
        raise RowError(f"SFT data {data}: {exc}") from None
    examples, refused = [], []
    for where, index, row in rows:
        try:
            examples.append(example(tokenizer, row, _row_id(where, index, row), vocab,
                                    max_tokens))  # fmt: skip
        except Exception as exc:  # a row's content (or a template's refusal) becomes data
            why = f"{where}: row {index}: {exc}"
            if not skip_bad_rows:
                raise RowError(why) from None
            refused.append(why)
    return SFTData(examples, seed, refused)


def next_position(trained_ids: Iterable[str], data: SFTData) -> int:
    """The first position of ``data`` not yet trained, given the episode ids of every step
    trained so far (the ledger's): one after the highest of this data set's ids."""
    prefix = f"{SFT_DOMAIN}-{data.fingerprint}-"
    positions = [int(i[len(prefix):]) for i in trained_ids
                 if i.startswith(prefix) and i[len(prefix):].isdigit()]
    return max(positions, default=-1) + 1


__all__ = ["Example", "RowError", "SFTData", "as_trajectory", "load_sft_data", "next_position",
           "render_chat", "token_row"]
