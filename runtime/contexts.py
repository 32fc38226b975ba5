"""Context by reference around the handlers: a multi-turn episode's turn messages carry the
tokens that turn added and the names of the stored parts before them
(:mod:`streamrl.protocol.contexts`); handlers see whole contexts.

- :func:`resolve` (before ``handle``): the parts an input names are read (one HMGET of the
  episode's hash ``Names.context(episode id)``, in the entry's shard) and joined with the
  message's own samples into the whole context, the message the handler gets; the stored
  base is remembered for the outputs;
- :func:`externalize` (after ``handle``): a ``Rollout`` carries its samples' tails after the
  input's stored base (what the generator added: the observation and the reply) and the
  same part names; a continuation ``Task``, and the ``Executed`` that ends the episode,
  store their tails (the last reply, now with its observation) as one new part, written by
  the hand-off script under its dedup key (:attr:`queues.streams.Handoff.stores`: a
  replayed hand-off stores nothing), and carry the part names only. So every turn writes
  what it added (twice: inline in the rollout, then as the part), never the whole context;
- the verifier's input (``Executed``) is joined once, whole, for the ``Trajectory`` the
  learner trains on (it carries every token, mask and version, as before), and the
  verifier's hand-off deletes the episode's hash in the same script
  (:attr:`Stored.ends`), whatever it publishes (a zero-variance skip publishes nothing).

Why no part a pending entry needs is ever gone: parts are only added while the episode runs
(each by the hand-off that publishes the entry naming it, atomically), never changed; the
hash is deleted only by the hand-off that publishes the episode's end, and that hand-off
acknowledges the episode's last entry: every earlier entry was acknowledged by the hand-off
that published its successor, so no entry of the episode is pending or can be delivered
again (reclaim, redelivery, a restart's own pending list) once it is gone; a duplicate
handler still running then (a slow consumer whose entry was reclaimed) publishes nothing
(its dedup key exists) and its dead letter copies nothing (the entry is acknowledged). An
episode that never ends (dead-lettered) keeps its hash, renewed at each turn, for
``queues.blob_ttl_s`` (the claim check's safety net), so ``dlq requeue`` of its turn finds
its context in that time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import structlog

from streamrl.protocol import contexts as C
from streamrl.protocol.messages import Episode, Executed, Message, Rollout, Sample, Task
from streamrl.queues.keys import Layout
from streamrl.queues.shards import Consumer

log = structlog.get_logger()
replace = msgspec.structs.replace


@dataclass(frozen=True)
class Stored:
    """What an input held by reference: its part names and their joined context."""

    refs: list[str] = field(default_factory=list)
    base: list[Sample] | None = None  # None: nothing stored (the episode's first turn)
    ends: str = ""  # the hash to delete with this hand-off: the input ends its episode


def _episode(message: Message) -> Episode | None:
    if isinstance(message, Task):
        return message.episode
    if isinstance(message, (Rollout, Executed)):
        task = message.task if isinstance(message, Rollout) else message.rollout.task
        return task.episode
    return None


async def resolve(consumer: Consumer, entry_id: str, message: Message) -> tuple[Message, Stored]:
    """``message`` with whole contexts, and what it held by reference. Raises
    :class:`protocol.contexts.ContextError` when a part is gone or does not decode."""
    ep = _episode(message)
    if ep is None:
        return message, Stored()
    key = consumer.names.context(ep.id)
    if not ep.context:
        return message, Stored(ends=key if isinstance(message, Executed) else "")
    raw = await consumer.read_stored(entry_id, key, list(ep.context))
    parts = []
    for name, value in zip(ep.context, raw, strict=True):
        if value is None:
            raise C.ContextError(f"stored context part {name!r} of {key} is missing (expired, "
                                 "or its episode ended already)")
        parts.append(C.decode_part(value, name))
    base = C.join(parts)
    stored = Stored(list(ep.context), base)
    if isinstance(message, Rollout):
        whole = C.join([*parts, message.samples]) if message.samples else base
        task = replace(message.task, episode=replace(ep, context=[]))
        return replace(message, task=task, samples=whole), stored
    if isinstance(message, Executed):
        r = message.rollout
        whole = C.join([*parts, r.samples]) if r.samples else base
        task = replace(r.task, episode=replace(ep, context=[]))
        return replace(message, rollout=replace(r, task=task, samples=whole)), Stored(ends=key)
    assert isinstance(message, Task)
    whole = C.join([*parts, ep.samples]) if ep.samples else base
    return replace(message, episode=replace(ep, samples=whole, context=[])), stored


@dataclass
class Externalized:
    messages: list[msgspec.Struct]
    stores: list[tuple[str, str, bytes]] = field(default_factory=list)
    deletes: list[str] = field(default_factory=list)


def externalize(names: Layout, stored: Stored, messages: list[msgspec.Struct]) -> Externalized:
    """The outputs of a turn by reference (module docstring), with the parts to store and
    the hashes to delete in their hand-off."""
    out = Externalized([], deletes=[stored.ends] if stored.ends else [])
    for m in messages:
        ep = _episode(m) if isinstance(m, Message) else None
        if ep is None:
            out.messages.append(m)
        elif isinstance(m, Executed):
            out.messages.append(_executed(names, m, ep, stored, out))
        elif isinstance(m, Rollout):
            out.messages.append(_rollout(m, ep, stored))
        elif isinstance(m, Task) and ep.samples:
            out.messages.append(_task(names, m, ep, stored, out))
        else:
            out.messages.append(m)
    return out


def _tails(samples: list[Sample], stored: Stored) -> list[Sample] | None:
    if stored.base is None:
        return samples
    tails = C.split(samples, stored.base)
    if tails is None:
        log.warning("context does not extend its stored base: sent whole",
                    tokens=C.tokens(samples))
    return tails


def _rollout(m: Rollout, ep: Episode, stored: Stored) -> Rollout:
    tails = _tails(m.samples, stored)
    if tails is None:
        return replace(m, task=replace(m.task, episode=replace(ep, context=[])))
    return replace(m, samples=tails, task=replace(m.task, episode=replace(ep, context=stored.refs)))


def _task(names: Layout, m: Task, ep: Episode, stored: Stored, out: Externalized) -> Task:
    tails = _tails(ep.samples, stored)
    if tails is None:
        return replace(m, episode=replace(ep, context=[]))
    part = f"{ep.turn}:{m.id}"
    out.stores.append((names.context(ep.id), part, C.encode_part(tails)))
    return replace(m, episode=replace(ep, samples=[], context=[*stored.refs, part]))


def _executed(names: Layout, m: Executed, ep: Episode, stored: Stored,
              out: Externalized) -> Executed:
    r = m.rollout
    tails = _tails(r.samples, stored)
    if tails is None:
        return m
    part = f"{ep.turn}:{m.id}"
    out.stores.append((names.context(ep.id), part, C.encode_part(tails)))
    task = replace(r.task, episode=replace(ep, context=[*stored.refs, part]))
    return replace(m, rollout=replace(r, task=task, samples=[]))
