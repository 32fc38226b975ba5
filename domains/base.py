"""The domain contract: where tasks come from, how they are shown, run and scored.

A domain is a plugin: a data set of items (the task source), a prompt renderer, an episode
policy (single- or multi-turn), a sandbox spec (backend, image, limits, files to stage) and a
verifier. Built-in domains are registered exactly as third-party ones are, through the
``streamrl.domains`` entry-point group (``domains.registry``); adding one touches no actor
code, and its weight, priority, limits and turns come from a ``[domain.<name>]`` TOML table
(``config.schema.DomainConfig``).

Guarantees every domain keeps:
- ``item_type`` is a msgspec-convertible type (a ``msgspec.Struct``) with at least ``id`` and
  ``prompt`` fields; items travel on the wire as ``msgspec.to_builtins(item)`` in
  ``Task.spec`` and are rebuilt with ``msgspec.convert(spec, domain.item_type)``;
- ``load_items(split)`` is deterministic, and the ``"train"`` and ``"eval"`` splits share no
  prompt;
- ``render_prompt`` uses the model's own chat template;
- ``exec_request`` and ``score`` never raise for anything the model wrote: code that is
  missing, malformed, crashing or hanging, or an answer that is garbage, huge or hostile,
  just scores low. ``score`` is in [0, 1];
- a reward of 0 means the answer was judged wrong. When the check itself fails (a test
  script that writes no reward, a harness that crashed, a third-party scorer that raised),
  ``score`` raises :class:`VerifierFailed` with the reason: the group is never trained on
  it, and the failure counts against the domain (``actors/verifier.py``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

import msgspec

from streamrl.sandbox.base import ExecRequest, ExecResult, Limits

T = TypeVar("T")


class VerifierFailed(Exception):
    """The verifier could not judge a completion (not: judged it wrong). Raised by a
    domain's ``score`` (or ``score_episode``) with the reason; never for what the model
    wrote. The verifier actor dead-letters the group at once under cause ``unjudged``."""


@dataclass(frozen=True)
class EpisodePolicy:
    """How many model turns an episode may take. Single-turn: one completion, one verdict.
    Multi-turn: the model acts, the sandbox's observation is appended, until the domain says
    done, ``max_turns`` model turns, ``max_total_tokens`` tokens in the context (the
    generator), ``max_tool_calls`` runs in the sandbox, or ``timeout_s`` seconds since the
    episode's first task was created (the executor, after each turn: :meth:`ended_by`).
    ``[domain.<name>]`` sets each of them in TOML (domains/declared.py ``with_budgets``)."""

    multi_turn: bool = False
    max_turns: int = 1
    max_total_tokens: int = 0  # 0: no budget beyond the model's context
    max_tool_calls: int = 0  # 0: no limit beyond max_turns
    timeout_s: float = 0.0  # wall clock of the whole episode; 0: none

    def __post_init__(self) -> None:
        if self.max_turns < 1 or (not self.multi_turn and self.max_turns != 1):
            raise ValueError("max_turns must be >= 1, and exactly 1 for a single-turn domain")
        if self.max_total_tokens < 0 or self.max_tool_calls < 0 or self.timeout_s < 0:
            raise ValueError("max_total_tokens, max_tool_calls and timeout_s must be >= 0")

    def ended_by(self, turn: int, tool_calls: int, elapsed_s: float) -> str:
        """Why a member that has taken ``turn`` model turns and made ``tool_calls`` calls,
        ``elapsed_s`` seconds into its episode, must end now ("" if it may go on)."""
        if turn >= self.max_turns:
            return "max_turns"
        if self.max_tool_calls and tool_calls >= self.max_tool_calls:
            return "tool_calls"
        if self.timeout_s and elapsed_s >= self.timeout_s:
            return "wall_clock"
        return ""


SINGLE_TURN = EpisodePolicy()


@dataclass(frozen=True)
class SandboxSpec:
    """Where a domain's code runs: backend name (``executor.backend`` when empty), container
    image (for container backends; the process backend runs the host's python3), resource
    limits, and files staged into the work dir of every run before the request's own."""

    backend: str = ""
    image: str = ""
    limits: Limits = field(default_factory=Limits)
    files: dict[str, bytes] = field(default_factory=dict)

    def with_overrides(self, timeout_s: float = 0.0, memory_mb: int = 0) -> SandboxSpec:
        """This spec with the limits a domain's TOML table sets (0: keep the domain's)."""
        return replace(self, limits=self.limits.with_overrides(timeout_s, memory_mb))


NO_SANDBOX = SandboxSpec()


class Domain(Protocol):
    name: str
    item_type: type
    default_max_new_tokens: int  # the calibrated generation budget for this domain
    episode: EpisodePolicy
    sandbox: SandboxSpec

    def load_items(self, split: str) -> list[Any]: ...

    def render_prompt(self, item: Any, tokenizer: Any) -> list[int]: ...

    def exec_request(self, item: Any, completion_text: str) -> ExecRequest | None: ...

    def score(self, item: Any, completion_text: str, result: ExecResult | None) -> float: ...


class MultiTurnDomain(Domain, Protocol):
    """A domain whose ``episode.multi_turn`` is true (the executor's turn loop,
    ``actors/episodes.py``). Each member of a group holds one sandbox session for its whole
    episode; every model turn:

    - ``exec_request(item, turn_text)``: what to run for this turn (None: nothing), in the
      member's session (the request's limits are ignored: the session's apply);
    - ``render_observation(item, result)``: the text fed back to the model (``result`` is
      None when nothing ran); bounded in size whatever the command printed;
    - ``is_done(item, turn_text, result)``: the episode is over (the model said so, or the
      result says the task is solved: ``code`` with feedback ends once the visible tests pass);
    - optionally ``tool_calls(item, turn_text)``: the sandbox calls this turn made (default:
      1 if ``exec_request`` ran something), counted against ``episode.max_tool_calls``.

    When a member ends (done, ``max_turns``, token budget) ``final_request(item)`` runs in
    its session, after everything the model did (the hidden check: staged only now, never
    visible to the model's commands), and ``score(item, last_turn_text, final_result)`` is
    its reward; a domain whose reward depends on the turns (a per-turn penalty) defines
    ``score_episode(item, turns, final_result)`` instead, and the verifier calls that with
    every :class:`~streamrl.protocol.messages.Turn` of the member.
    ``session_files(item)`` are staged in a fresh session before turn 1.
    """

    def session_files(self, item: Any) -> dict[str, bytes]: ...

    def render_observation(self, item: Any, result: ExecResult | None) -> str: ...

    def is_done(self, item: Any, turn_text: str, result: ExecResult | None = None) -> bool: ...

    def final_request(self, item: Any) -> ExecRequest | None: ...


def is_multi_turn(domain: Any) -> bool:
    return bool(getattr(getattr(domain, "episode", None), "multi_turn", False))


def item_image(domain: Any, item: Any) -> str:
    """The container image ``item`` asks for (``domain.item_image(item)``; e.g. a repository
    task's ``extra["image"]``), "" for the domain's own. Container backends only."""
    hook = getattr(domain, "item_image", None)
    return str(hook(item) or "") if hook is not None else ""


def is_agent_driven(domain: Any) -> bool:
    """An external agent drives this domain's episodes (``[domain.<name>.agent]``:
    actors/agents.py), not the generator's turn loop."""
    return bool(getattr(getattr(domain, "agent", None), "command", None))


def tool_calls(domain: Any, item: Any, texts: list[str]) -> int:
    """The sandbox calls the turns ``texts`` of one member made (``episode.max_tool_calls``)."""
    count = getattr(domain, "tool_calls", None)
    if count is not None:
        return sum(int(count(item, t)) for t in texts)
    return sum(1 for t in texts if domain.exec_request(item, t) is not None)


_TURN_MARK = "\x00streamrl-turn\x00"


def chat_observation_ids(
    tokenizer: Any, observation: str, closed: bool, role: str = "user"
) -> list[int]:
    """Token ids that close the model's turn (unless ``closed``: its completion already ended
    with the end-of-turn token), add ``observation`` as a ``role`` message and open the next
    assistant turn, all in the model's own chat template. Derived by rendering a dummy
    conversation with and without the observation, so any template works whose rendering of
    a conversation is a prefix of the rendering of its continuation."""
    convo = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _TURN_MARK}]
    before = tokenizer.apply_chat_template(convo, tokenize=False)
    after = tokenizer.apply_chat_template(
        [*convo, {"role": role, "content": observation}], tokenize=False,
        add_generation_prompt=True,
    )
    if not after.startswith(before):
        raise ValueError("chat template: a conversation does not render as a prefix of its "
                         "continuation; cannot append observations")
    closing = before[before.index(_TURN_MARK) + len(_TURN_MARK):]
    eos = getattr(tokenizer, "eos_token", None) or ""
    if closed and eos and closing.startswith(eos):
        closing = closing[len(eos):]
    text = closing + after[len(before):]
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]


def chat_prompt_ids(tokenizer: Any, user: str, system: str | None = None) -> list[int]:
    """Token ids of a one-turn chat, ending with the assistant header (generation prompt)."""
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": user})
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding by default
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def load_task_file(path: Path, item_type: type[T]) -> list[T]:
    """The task source: items from a local ``.jsonl`` (one JSON object a line) or ``.parquet``
    file (one row an item), validated against ``item_type``. A bad row is an error naming
    the file and the row, raised at load time, never mid-run."""
    rows: list[Any]
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq  # optional: only parquet task files need it

        rows = pq.read_table(path).to_pylist()
    else:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    items = []
    for i, row in enumerate(rows):
        try:
            items.append(msgspec.convert(row, item_type))
        except msgspec.ValidationError as exc:
            raise ValueError(f"{path}: row {i}: {exc}") from None
    return items


def write_jsonl(items: list[Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [msgspec.json.encode(it).decode() for it in items]
    path.write_text("".join(line + "\n" for line in lines))


def unique_splits(
    make_item: Callable[[str, int], Any], n_eval: int, n_train: int
) -> dict[str, list[Any]]:
    """``{"eval": [...], "train": [...]}`` of ``make_item(split, index)`` with no prompt twice
    across both splits (eval drawn first, so the held-out set does not depend on n_train)."""
    seen: set[str] = set()
    out: dict[str, list[Any]] = {"eval": [], "train": []}
    for split, n in (("eval", n_eval), ("train", n_train)):
        while len(out[split]) < n:
            item = make_item(split, len(out[split]))
            if item.prompt not in seen:
                seen.add(item.prompt)
                out[split].append(item)
    return out


def write_splits(splits: dict[str, list[Any]], data_dir: Path) -> None:
    for split, items in splits.items():
        write_jsonl(items, data_dir / f"{split}.jsonl")


class SplitFiles:
    """Mixin: ``load_items`` from ``<data_dir>/<split>.jsonl`` (or ``.parquet``), cached."""

    item_type: type
    data_dir: Path

    def load_items(self, split: str) -> list[Any]:
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', not {split!r}")
        cache: dict[str, list[Any]] = self.__dict__.setdefault("_split_cache", {})
        if split not in cache:
            path = self.data_dir / f"{split}.jsonl"
            if not path.exists() and (self.data_dir / f"{split}.parquet").exists():
                path = self.data_dir / f"{split}.parquet"
            cache[split] = load_task_file(path, self.item_type)
        return list(cache[split])
