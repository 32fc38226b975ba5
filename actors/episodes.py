"""Multi-turn episodes: the generator's and the executor's halves of one turn.

An episode is a GRPO group of ``group_size`` members of the same task advancing turn by turn:

    tasks --generator--> rollouts --executor--> tasks (continuation) --generator--> ...
                                            \\-> executed (every member ended) --> verifier

Guarantees:
- the state travels with the messages (``Task.episode``: the prompt, each member's context
  so far, why each member ended, each ended member's final check, each live member's
  sandbox snapshot), so ANY generator or executor replica can take the next turn; a replica
  that dies mid-turn loses nothing: its input stays pending and is redelivered, and the
  redone turn starts from the state of the previous one (the sandbox from its snapshot);
- only model-produced tokens are trained: each member's ``Sample.mask`` is 1 on the model's
  tokens and 0 on the observation tokens the chat template wraps around what the sandbox
  answered; those have no behaviour logprobs (0);
- members that ended stay ended; an episode ends when every member did: the domain said done
  (``is_done``), ``max_turns`` model turns, or the token budget (``max_total_tokens``: the
  prompt, every turn and observation) has no room for the next turn. The hidden check
  (``final_request``) runs in the member's session as soon as it ends, then the session is
  released;
- every inference request of an episode carries the episode id as its session, so the
  SGLang client keeps it on one server (prefix cache);
- a sandbox session lives for a member's whole episode and is released on every exit path:
  the member ended (done, max turns, budget), the handler failed or was cancelled (retry,
  dead letter, time limit, shutdown), the executor closed, or the episode left this replica
  (idle for ``executor.session_idle_s``: it moved to another replica, or died elsewhere).

Sessions (:class:`EpisodeSessions`): each executor keeps the sessions of the episodes it is
running in a local cache keyed by (episode id, member): the fast path, when the next turn
comes back to the same replica. After each turn it also snapshots the session's work dir
(``tar -cz``, bounded by the session's output limit) into the message, which the claim
check (queues/payloads.py) moves out of band when large: the slow path, when another replica
takes the next turn, or a turn is redone. A cached session is used only if it holds exactly
the previous turn's effects as published (its last snapshot's digest matches the message's);
otherwise it is reset and restored from the snapshot, so a turn redone after a crash never
sees its own half-applied effects, and a turn redone after its hand-off went through never
replaces the published state. A turn that ran no command carries the previous snapshot
over. A member whose state cannot be restored (no snapshot: the work dir did not fit, or
``executor.episode_snapshots`` is off) ends as ``"lost"`` with an empty check result
(reward 0); the rest of its group goes on.
"""

from __future__ import annotations

import hashlib
import math
import secrets
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import numpy as np
import structlog
import trio

from streamrl.domains.base import chat_observation_ids, item_image
from streamrl.inference.chat import ToolResult, tool_format, tool_results_ids
from streamrl.protocol.messages import (
    Episode,
    ExecOutcome,
    Sample,
    Sampling,
    Task,
    ToolReply,
    Turn,
    bytes_to_floats,
    bytes_to_ids,
    floats_to_bytes,
    ids_to_bytes,
)
from streamrl.sandbox.base import ExecRequest, ExecResult, SandboxSession

log = structlog.get_logger()

replace = msgspec.structs.replace

SNAPSHOT_ARGV = ["tar", "-czf", "-", "."]
RESTORE_ARGV = ["tar", "-xzf", "-"]  # the snapshot on stdin: nothing to write in the work dir
LOST = ExecOutcome(exit_code=None, stdout="", stderr="sandbox session lost (no snapshot)",
                   timed_out=False, oom_killed=False, duration_s=0.0)


# --------------------------------------------------------------------------- generator


@dataclass
class Context:
    """One member's context after the prompt, built up turn by turn."""

    tokens: list[np.ndarray] = field(default_factory=list)
    logprobs: list[np.ndarray] = field(default_factory=list)
    mask: list[np.ndarray] = field(default_factory=list)
    versions: list[np.ndarray] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "stop"
    weight_version: int = -1
    length: int = 0

    @classmethod
    def of(cls, s: Sample) -> Context:
        tokens = bytes_to_ids(s.tokens)
        mask = np.frombuffer(s.mask, dtype=np.uint8) if s.mask else np.ones(len(tokens), np.uint8)
        return cls([tokens], [bytes_to_floats(s.logprobs)], [mask], [s.token_versions()],
                   list(s.turns), s.text, s.finish_reason, s.weight_version, len(tokens))

    def ids(self) -> list[int]:
        return np.concatenate(self.tokens).tolist() if self.tokens else []

    def add(self, tokens: Sequence[int], logprobs: Sequence[float] | None,
            versions: Sequence[int] | None = None) -> None:
        """Append model tokens (with their behaviour logprobs and weight versions) or, with
        ``logprobs=None``, observation tokens (not trained, logprob 0, the oldest version so
        far: they never make a sample look older than its oldest model token)."""
        n = len(tokens)
        oldest = max(self.weight_version, 0)
        self.versions.append(np.asarray(versions, np.int32) if versions is not None
                             else np.full(n, oldest, np.int32))
        self.tokens.append(np.asarray(tokens, dtype=np.int32))
        model = logprobs is not None
        self.logprobs.append(np.asarray(logprobs, np.float32) if model else np.zeros(n, np.float32))
        self.mask.append(np.full(n, 1 if model else 0, dtype=np.uint8))
        self.length += n

    def sample(self) -> Sample:
        def cat(parts: list[np.ndarray], dtype: Any) -> np.ndarray:
            return np.concatenate(parts) if parts else np.zeros(0, dtype)

        return Sample(
            tokens=ids_to_bytes(cat(self.tokens, np.int32)),
            logprobs=floats_to_bytes(cat(self.logprobs, np.float32)),
            text=self.text,
            finish_reason=self.finish_reason,
            weight_version=max(self.weight_version, 0),
            mask=cat(self.mask, np.uint8).tobytes(),
            turns=self.turns,
            versions=ids_to_bytes(cat(self.versions, np.int32)),
        )


def observation_ids(tokenizer: Any, domain: Any, turn: Turn, closed: bool) -> list[int]:
    """The tokens after a model turn, up to the next assistant header: its tool results as
    ``tool`` messages (a domain with tools), else its observation as a user message."""
    if turn.tools:
        results = [ToolResult(call_id=r.call_id, name=r.name, content=r.content, error=r.error)
                   for r in turn.tools]
        return tool_results_ids(tokenizer, results, closed, getattr(domain, "tools", ()))
    return chat_observation_ids(tokenizer, turn.observation, closed=closed)


class Generate(Protocol):
    async def __call__(
        self, prompts: list[list[int]], sampling: Sampling, session: str
    ) -> list[Any]: ...


async def generate_turn(
    task: Task, domain: Any, item: Any, tokenizer: Any, generate: Generate, budget: int
) -> tuple[Task, bytes, list[Sample]]:
    """The next model turn of every live member of ``task``'s episode (the first if the task
    has no episode yet): ``(task with the episode state, prompt ids, samples)``. Appends each
    live member's pending observation (chat template, masked out) first; a member without
    room for at least one more token under ``budget`` (0: none) ends as ``"budget"``."""
    g = task.group_size
    ep = task.episode
    if ep is None:
        prompt = domain.render_prompt(item, tokenizer)
        # a domain with tools: the executor parses the replies in the model's own format
        fmt = tool_format(tokenizer) if getattr(domain, "tools", None) else ""
        ep = Episode(id=task.id, prompt_ids=ids_to_bytes(prompt), ended=[""] * g,
                     outcomes=[None] * g, snapshots=[b""] * g, tool_format=fmt)
        contexts = [Context() for _ in range(g)]
    else:
        prompt = bytes_to_ids(ep.prompt_ids).tolist()
        contexts = [Context.of(s) for s in ep.samples]
    ended = list(ep.ended)
    room: dict[int, int] = {}
    for i, ctx in enumerate(contexts):
        if ended[i]:
            continue
        if ctx.turns:  # the observation of the previous turn
            obs = observation_ids(tokenizer, domain, ctx.turns[-1],
                                  closed=ctx.finish_reason == "stop")
            left = budget - len(prompt) - ctx.length - len(obs) if budget else math.inf
            if left < 1:
                ended[i] = "budget"
                continue
            ctx.add(obs, None)
        left = budget - len(prompt) - ctx.length if budget else math.inf
        if left < 1:
            ended[i] = "budget"
            continue
        room[i] = int(min(left, task.sampling.max_new_tokens))
    live = sorted(room)
    if live:
        sampling = replace(task.sampling, max_new_tokens=max(room.values()))
        completions = await generate([prompt + contexts[i].ids() for i in live], sampling, ep.id)
        for i, c in zip(live, completions, strict=True):
            ctx, n = contexts[i], room[i]
            cut = len(c.tokens) > n
            tokens, logprobs = c.tokens[:n], c.logprobs[:n]
            ctx.add(tokens, logprobs, c.token_versions()[:n])
            ctx.text = tokenizer.decode(tokens, skip_special_tokens=True) if cut else c.text
            ctx.finish_reason = "length" if cut else c.finish_reason
            ctx.turns.append(Turn(text=ctx.text))
            v = c.weight_version
            ctx.weight_version = v if ctx.weight_version < 0 else min(ctx.weight_version, v)
    state = replace(ep, turn=ep.turn + (1 if live else 0), samples=[], ended=ended)
    return replace(task, episode=state), ep.prompt_ids, [c.sample() for c in contexts]


# --------------------------------------------------------------------------- executor


class LostSession(Exception):
    """A member's sandbox state cannot be restored on this replica."""


class SessionSource(Protocol):
    def session(self, domain: Any, label: str, item_image: str = ""
                ) -> AbstractAsyncContextManager[SandboxSession]: ...

    def staged_files(self, domain: Any) -> dict[str, bytes]: ...


@dataclass
class Held:
    """A cached session. ``turn``: the last turn whose effects it holds (-1: unknown, e.g.
    a command of a turn that never completed here ran in it)."""

    cm: AbstractAsyncContextManager[SandboxSession]
    session: SandboxSession
    turn: int
    fresh: bool
    used: float
    lock: trio.Lock = field(default_factory=trio.Lock)
    digest: bytes = b""  # of the snapshot this session's state was last published as


class EpisodeSessions:
    """The executor's sessions of live episodes, keyed by (episode id, member)."""

    def __init__(self, source: SessionSource, *, snapshots: bool = True, idle_s: float = 600.0):
        self.source = source
        self.snapshots = snapshots
        self.idle_s = idle_s
        self._held: dict[tuple[str, int], Held] = {}
        self.restored = 0  # slow paths taken (statistics, tests)

    def __len__(self) -> int:
        return len(self._held)

    def episodes(self) -> set[str]:
        return {e for e, _ in self._held}

    async def checkout(self, domain: Any, item: Any, episode_id: str, member: int, turn: int,
                       snapshot: bytes) -> Held:
        """The member's session holding the effects of turns 1..``turn`` - 1 (locked by the
        caller). Raises :class:`LostSession`, or ``SandboxUnavailable``."""
        key = (episode_id, member)
        held = self._held.get(key)
        if held is None:
            # the episode names what the backend creates; the suffix keeps two replicas'
            # sessions of one episode apart (the old one may still be cached elsewhere)
            label = f"{episode_id[:16]}-{member}-{secrets.token_hex(3)}"
            cm = self.source.session(domain, label=label, item_image=item_image(domain, item))
            session = await cm.__aenter__()
            held = self._held[key] = Held(cm, session, -1, True, trio.current_time())
        held.used = trio.current_time()
        # The fast path: the session holds the previous turn's effects, and they are the ones
        # the message carries (a turn redone here after its hand-off had gone through, e.g.
        # a redelivery, may have left other effects than the published ones).
        if held.turn == turn - 1 and not held.fresh and (
                not snapshot or held.digest == _digest(snapshot)):
            return held
        if not held.fresh:
            await held.session.reset()
        held.fresh = False
        if turn <= 1:
            await held.session.put_files({**self.source.staged_files(domain),
                                          **domain.session_files(item)})
        else:
            if not snapshot:
                raise LostSession(f"member {member}: no snapshot of turn {turn - 1}")
            result = await held.session.run(ExecRequest(argv=RESTORE_ARGV, stdin=snapshot))
            if not result.ok:
                raise LostSession(f"member {member}: restore failed: {result.stderr[-300:]!r}")
            self.restored += 1
            log.info("session restored", member=member, turn=turn - 1, bytes=len(snapshot))
        held.turn, held.digest = turn - 1, _digest(snapshot)
        return held

    async def snapshot(self, held: Held) -> bytes:
        """The session's work dir as a gzipped tar (b"" if it does not fit the output cap)."""
        if not self.snapshots:
            return b""
        r = await held.session.run(ExecRequest(argv=SNAPSHOT_ARGV))
        if not r.ok or r.stdout_dropped:
            log.warning("session snapshot failed", exit_code=r.exit_code,
                        dropped=r.stdout_dropped, stderr=r.stderr[-200:].decode("utf-8", "replace"))
            held.digest = b""
            return b""
        held.digest = _digest(r.stdout)
        return r.stdout

    async def release(self, episode_id: str, member: int | None = None) -> None:
        keys = [k for k in self._held if k[0] == episode_id and member in (None, k[1])]
        await self._close(keys)

    async def release_idle(self) -> int:
        cutoff = trio.current_time() - self.idle_s
        keys = [k for k, h in self._held.items() if h.used < cutoff and not h.lock.locked()]
        if keys:
            log.info("idle episode sessions released", sessions=len(keys))
        await self._close(keys)
        return len(keys)

    async def serve_idle_release(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await trio.sleep(max(0.05, min(self.idle_s / 2, 30.0)))
            await self.release_idle()

    async def aclose(self) -> None:
        await self._close(list(self._held))

    async def _close(self, keys: list[tuple[str, int]]) -> None:
        with trio.CancelScope(shield=True):
            for key in keys:
                held = self._held.pop(key, None)
                if held is not None:
                    try:
                        await held.cm.__aexit__(None, None, None)
                    except Exception as exc:  # a session that fails to close is logged
                        log.warning("session close failed", error=repr(exc))


def _digest(snapshot: bytes) -> bytes:
    return hashlib.blake2b(snapshot, digest_size=16).digest() if snapshot else b""


@dataclass
class TurnState:
    """The executor's working copy of one episode turn."""

    samples: list[Sample]
    ended: list[str]
    outcomes: list[ExecOutcome | None]
    snapshots: list[bytes]
    unavailable: list[str] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(o is not None for o in self.outcomes)


def observed(sample: Sample, observation: str, result: ExecResult | None,
             tools: Sequence[ToolReply] = ()) -> Sample:
    turns = list(sample.turns)
    if turns:
        turns[-1] = replace(turns[-1], observation=observation, tools=list(tools),
                            exit_code=None if result is None else result.exit_code)
    return replace(sample, turns=turns)
