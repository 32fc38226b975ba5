"""The wire format: every message that crosses a stream, as typed frozen structs.

Guarantees:
- one encoding, MessagePack via msgspec; never pickle;
- token ids and logprobs travel as raw little-endian bytes (int32 / float32);
- every message carries ``id`` (logical id, stable across redeliveries), ``created_at``,
  ``attempt`` and the ``policy_version`` it was produced under, plus the schema version ``v``;
- decoding validates the schema: a payload that is not valid MessagePack, has the wrong
  types, misses fields, has fields the message does not know or carries another schema
  version raises :class:`MessageError`, which the consumer turns into a dead letter.

This module knows nothing of Redis; the field names describe an RL pipeline, but the queue
machinery in ``queues.streams`` only ever sees bytes.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any

import msgspec
import numpy as np

SCHEMA_VERSION = 1


class Message(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of every pipeline message. Unknown fields are an error, like another schema
    version: a message of another type whose fields are a superset (a ``Trajectory`` pushed
    into the verifier's ``executed`` stream) must not pass for this one."""

    id: str
    created_at: float
    policy_version: int
    attempt: int = 0
    v: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.v != SCHEMA_VERSION:
            raise ValueError(f"schema version {self.v}, expected {SCHEMA_VERSION}")

    @property
    def episode_id(self) -> str:
        """The episode (GRPO group) this message belongs to, for logs and replay."""
        return self.id


def new_id() -> str:
    return uuid.uuid4().hex


def now() -> float:
    return time.time()


# --------------------------------------------------------------------------- arrays


def ids_to_bytes(ids: Any) -> bytes:
    return np.ascontiguousarray(ids, dtype="<i4").tobytes()


def bytes_to_ids(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, dtype="<i4")


def floats_to_bytes(values: Any) -> bytes:
    return np.ascontiguousarray(values, dtype="<f4").tobytes()


def bytes_to_floats(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, dtype="<f4")


# --------------------------------------------------------------------------- RL messages


# Bounds on fields that size work: a message outside them is malformed (dead-lettered on
# arrival) rather than an out-of-memory for the actor that takes it.
MAX_GROUP_SIZE = 1024
MAX_NEW_TOKENS = 1 << 17

GroupSize = Annotated[int, msgspec.Meta(ge=1, le=MAX_GROUP_SIZE)]
NewTokens = Annotated[int, msgspec.Meta(ge=1, le=MAX_NEW_TOKENS)]
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=100.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]


class Sampling(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    max_new_tokens: NewTokens = 64
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    seed: int | None = None


class Task(Message, frozen=True, kw_only=True):
    """One prompt to be answered ``group_size`` times (a GRPO group)."""

    domain: str
    item_id: str
    split: str  # "train" or "eval"
    prompt: str
    spec: dict[str, Any]  # domain-specific, e.g. the expected answer
    group_size: GroupSize
    sampling: Sampling
    eval_round: int = -1  # >= 0 for held-out evaluation tasks
    episode: Episode | None = None  # multi-turn: the episode's state (actors/episodes.py)

    @property
    def episode_id(self) -> str:
        return self.episode.id if self.episode is not None else self.id


class ToolReply(msgspec.Struct, frozen=True, kw_only=True):
    """The result of one tool call of a turn, fed back as a ``tool`` message."""

    call_id: str
    name: str
    content: str
    error: bool = False


class Turn(msgspec.Struct, frozen=True, kw_only=True):
    """One model turn of a multi-turn episode and what the environment answered: one
    ``observation`` (a user message), or, for a domain with tools, the ``tools`` results
    (``tool`` messages; ``observation`` then renders them for people: replay, logs)."""

    text: str  # what the model wrote
    observation: str = ""  # the domain's rendering of the sandbox result ("" before it ran)
    exit_code: int | None = None
    tools: list[ToolReply] = msgspec.field(default_factory=list)


class Sample(msgspec.Struct, frozen=True, kw_only=True):
    """One completion: tokens and the behaviour logprobs of the policy that sampled them.

    In a multi-turn episode ``tokens`` is the whole context after the prompt (model turns
    and the observations between them), ``mask`` says which tokens the model produced (only
    those are trained, and only they have behaviour logprobs; observation tokens carry 0),
    ``text`` is the latest turn's text and ``turns`` every turn."""

    tokens: bytes  # int32 LE
    logprobs: bytes  # float32 LE, one per token
    text: str
    finish_reason: str
    weight_version: int
    mask: bytes = b""  # uint8, one per token: 1 the model's, 0 an observation; b"": all 1
    turns: list[Turn] = []
    versions: bytes = b""
    """int32 LE, one per token: the weight version that produced it (weights may change in
    the middle of a completion: interruptible rollouts); b"": all ``weight_version``. A
    generator sets ``weight_version`` to the oldest of them (its first token's)."""

    def token_versions(self) -> np.ndarray:
        """The weight version of every token (int32)."""
        if self.versions:
            return np.frombuffer(self.versions, dtype="<i4")
        return np.full(len(self.tokens) // 4, self.weight_version, dtype=np.int32)


class Rollout(Message, frozen=True, kw_only=True):
    task: Task
    prompt_ids: bytes  # int32 LE
    samples: list[Sample]

    @property
    def episode_id(self) -> str:
        return self.task.episode_id


class ExecOutcome(msgspec.Struct, frozen=True, kw_only=True):
    exit_code: int | None
    stdout: str
    stderr: str
    timed_out: bool
    oom_killed: bool
    duration_s: float
    stdout_dropped: int = 0
    stderr_dropped: int = 0


class Episode(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The state of a multi-turn episode (a GRPO group of ``group_size`` members advancing
    turn by turn). It travels with the messages (``Task.episode``), so any generator or
    executor replica can take the next turn; large parts go by claim check."""

    id: str  # stable across turns and replicas: the first task's id
    turn: int = 0  # model turns taken so far
    prompt_ids: bytes = b""  # int32 LE, the rendered prompt
    samples: list[Sample] = []  # continuations: each member's context so far
    ended: list[str] = []  # per member: why it ended ("done", "max_turns", "budget", ...)
    outcomes: list[ExecOutcome | None] = []  # per member: the final check, once it ended
    snapshots: list[bytes] = []  # per member: its sandbox work dir after the last turn
    started_at: float = 0.0  # the first task's created_at (episode wall clock); 0: not yet
    tool_format: str = ""  # a domain with tools: how the model writes calls (the generator's)
    context: list[str] = []
    """The stored parts of every member's context, oldest first (fields of the hash
    ``Names.context(id)``, protocol/contexts.py): the message's own samples (``samples``
    here, ``Rollout.samples`` in a rollout) continue them. []: the samples are whole."""


class Executed(Message, frozen=True, kw_only=True):
    rollout: Rollout
    outcomes: list[ExecOutcome]

    @property
    def episode_id(self) -> str:
        return self.rollout.task.episode_id


class Trajectory(Message, frozen=True, kw_only=True):
    """A verified group: what the learner trains on (and what evaluation aggregates)."""

    rollout: Rollout
    outcomes: list[ExecOutcome]
    rewards: list[float]

    @property
    def episode_id(self) -> str:
        return self.rollout.task.episode_id


class WeightsPublished(Message, frozen=True, kw_only=True):
    version: int
    path: str


class StepMetrics(Message, frozen=True, kw_only=True):
    step: int
    loss: float
    grad_norm: float
    reward_mean: float
    groups: int
    samples: int
    tokens: int
    dropped_stale: int
    max_staleness_seen: int
    step_seconds: float
    wait_seconds: float
    # what the loss saw (learner.train.StepStats); defaults for metrics of older learners
    lr: float = 0.0
    entropy: float = 0.0  # mean per-token entropy of the policy
    clip_frac: float = 0.0  # tokens whose clip was active
    is_clip_frac: float = 0.0  # tokens whose importance weight was truncated or masked
    kl_ref: float = 0.0  # mean per-token KL to the reference
    # train-vs-rollout mismatch, ratio = pi_trainer / pi_behaviour per token before the step
    mismatch_kl: float = 0.0  # mean k3: ratio - 1 - log ratio
    mismatch_ratio_min: float = 1.0
    mismatch_ratio_mean: float = 1.0
    mismatch_ratio_max: float = 1.0
    no_signal: bool = False
    """No group of the step had learning signal (every reward of each group equal): the
    version learned nothing (published only with ``learner.step_without_signal``)."""


def carried_task(message: msgspec.Struct | None) -> Task | None:
    """The task ``message`` carries (a ``Task`` itself, or the task of a rollout, executed
    result or trajectory), else None."""
    if isinstance(message, Task):
        return message
    if isinstance(message, Rollout):
        return message.task
    if isinstance(message, (Executed, Trajectory)):
        return message.rollout.task
    return None


def training_task(message: msgspec.Struct) -> Task | None:
    """The task of the training group ``message`` carries (a ``Task`` of split "train", or a
    rollout, executed result or trajectory of one), else None."""
    task = carried_task(message)
    if task is None or task.split != "train" or task.eval_round >= 0:
        return None
    return task


def training_group(message: msgspec.Struct) -> str | None:
    """The group id (episode id) if ``message`` carries a training group
    (:func:`training_task`), else None. Its dead letter frees the group's admission slot if
    that group was admitted and is not settled yet (``queues/deadletter.lua``,
    :attr:`protocol.names.Names.admitted_groups`)."""
    task = training_task(message)
    return None if task is None else task.episode_id
