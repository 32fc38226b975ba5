"""``streamrl dlq``: inspect, requeue and purge dead letters.

Guarantees:
- ``requeue`` puts a dead letter's original payload back on its original stream as a new
  entry, so it runs again through the normal path (the stream's consumer group, every
  policy), and deletes it from the dead-letter stream in the same Lua script
  (``queues/requeue.lua``, :func:`queues.streams.requeue_dead_letter`): a letter is
  requeued once even if two operators requeue it at once or a reply is lost and the call
  is repeated (the script adds nothing for a letter that is no longer there); what it gives
  back (a training group's admission slot, its domain's failed and resolved counts) comes
  from the run's own records, never from the letter's fields, which any stage can write: the
  group the payload carries, only if a dead letter released it from the admission record,
  with what that letter's script recorded counting (each failed or resolved counter of the
  shard by one at most, none below zero);
- ``purge`` deletes only the letters it listed (letters dead-lettered meanwhile stay), and
  only after confirmation (``--yes`` for scripts);
- nothing here decodes more than it shows: a payload that does not decode as its stream's
  message is shown as bytes with the decoding error;
- ``show --out FILE`` writes one letter's whole payload, byte for byte, however large (a
  claim-check reference resolved to its blob, which must be one of the letter's own stream).

Sharded runs (``queues.shards`` > 1): every shard has its own dead-letter stream (in the
slot of the streams whose letters it holds); every command covers all of them, and a dead
letter's id is qualified by its shard (``<shard>:<entry id>``). A letter is requeued into
its original stream in its own shard, so the requeue stays one script in one slot.
"""

from __future__ import annotations

import json
import re
import sys
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from streamrl.protocol import names as N
from streamrl.protocol.messages import Executed, Rollout, Task, Trajectory, training_group
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import DeadLetter, MessageError, decode
from streamrl.queues.operations import delete_entries, get_blob, read_range
from streamrl.queues.payloads import REF_PREFIX, PayloadLimits
from streamrl.queues.shards import qualify, split_qualified
from streamrl.queues.streams import counted_keys, released_counters, requeue_dead_letter

MESSAGE_OF_STREAM: dict[str, type[msgspec.Struct]] = {
    N.TASKS: Task,
    N.ROLLOUTS: Rollout,
    N.EXECUTED: Executed,
    N.TRAJECTORIES: Trajectory,
    N.EVALS: Trajectory,
}

@dataclass(frozen=True)
class DeadEntry:
    dead_id: str
    """Entry id in the dead-letter stream (what ``show``/``requeue``/``purge`` take)."""
    letter: DeadLetter | None
    """None: the dead entry itself could not be decoded (see ``error``)."""
    error: str
    counted: tuple[str, ...] = ()
    """The counter keys the letter says it added with its released ticket (its field
    ``counted``): shown, never trusted (a requeue reads what the release recorded)."""

    @property
    def age_s(self) -> float:
        if self.letter is not None:
            return max(0.0, time.time() - self.letter.at)
        return max(0.0, time.time() - int(self.dead_id.split("-")[0]) / 1000)

    def summary(self) -> dict[str, Any]:
        letter = self.letter
        return {
            "id": self.dead_id,
            "stream": letter.stream if letter else None,
            "group": letter.group if letter else None,
            "entry_id": letter.entry_id if letter else None,
            "deliveries": letter.deliveries if letter else None,
            "age_s": round(self.age_s, 1),
            "error": self.error,
            "payload_bytes": len(letter.payload) if letter else None,
        }


@dataclass(frozen=True)
class Selection:
    ids: tuple[str, ...] = ()
    stream: str | None = None
    error: str | None = None
    """Regular expression searched in the error text."""
    all: bool = False

    @property
    def empty(self) -> bool:
        return not (self.ids or self.stream or self.error or self.all)

    def matches(self, entry: DeadEntry) -> bool:
        if self.ids and entry.dead_id not in self.ids:
            return False
        if self.stream and (entry.letter is None or entry.letter.stream != self.stream):
            return False
        return not (self.error and not re.search(self.error, entry.error))


def _str(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def list_dead(
    client: RedisClient, names: N.Names, selection: Selection | None = None
) -> list[DeadEntry]:
    """Every dead letter of the run that ``selection`` matches: oldest first (shard by shard
    on a sharded run)."""
    rows: list[tuple[str, Any]] = []
    for layout in names.layouts():
        for dead_id, fields in await read_range(client, layout.stream(N.DEAD)):
            if layout.shard is not None:
                dead_id = qualify(layout.shard, dead_id)
            rows.append((dead_id, fields))
    out = []
    for dead_id, fields in rows:
        try:
            letter: DeadLetter | None = decode(fields.get(b"d", b""), DeadLetter)
            error = letter.error if letter else ""
        except MessageError as exc:
            letter, error = None, f"(undecodable dead letter: {exc})"
        entry = DeadEntry(dead_id, letter, error, tuple(counted_keys(fields)))
        if selection is None or selection.matches(entry):
            out.append(entry)
    return out


def _readable(value: Any) -> Any:
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    if isinstance(value, dict):
        return {k: _readable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_readable(v) for v in value]
    return value


def decoded_payload(letter: DeadLetter) -> dict[str, Any]:
    """The payload as its stream's message (bytes fields shown by size), or why it is not one."""
    kind = MESSAGE_OF_STREAM.get(letter.stream)
    if kind is None:
        return {"undecoded": f"<{len(letter.payload)} bytes>", "why": "unknown stream"}
    try:
        message = decode(letter.payload, kind)
    except MessageError as exc:
        return {"undecoded": letter.payload[:256].hex(), "why": str(exc)}
    return {"type": kind.__name__, "message": _readable(msgspec.to_builtins(
        message, builtin_types=(bytes,)))}


async def full_payload(client: RedisClient, names: N.Names, entry: DeadEntry) -> bytes:
    """The whole payload of a dead letter: a claim-check reference resolved to its blob.
    :class:`LookupError` if the blob is gone or is not one of the letter's own stream."""
    if entry.letter is None:
        raise LookupError(f"dead letter {entry.dead_id} does not decode: no payload")
    payload = entry.letter.payload
    if not payload.startswith(REF_PREFIX):
        return payload
    key = payload[len(REF_PREFIX) :].decode("utf-8", "replace")
    layout, _ = _locate(names, entry.dead_id)
    if not key.startswith(layout.stream(entry.letter.stream) + ":blob:"):
        raise LookupError(f"claim-check reference {key!r} names no blob of {entry.letter.stream}")
    blob = await get_blob(client, key)
    if blob is None:
        raise LookupError(f"claim-check blob {key} is gone (expired or trimmed)")
    return blob


async def requeue(
    client: RedisClient,
    names: N.Names,
    entries: list[DeadEntry],
    limits: PayloadLimits | None = None,
) -> list[tuple[str, str | None]]:
    """Requeue each entry to its original stream; [(dead id, new entry id or None if it was
    gone already)]. The training group its payload carries takes back, in the same script,
    its admission slot and the domain counts its release added, if a dead letter released it
    (:func:`queues.streams.requeue_dead_letter`: the run's records, not the letter's fields).
    A payload over the claim-check size goes through the claim check."""
    limits = limits or PayloadLimits()
    done: list[tuple[str, str | None]] = []
    for entry in entries:
        if entry.letter is None or entry.letter.stream not in N.WORK_STREAMS:
            raise ValueError(f"dead letter {entry.dead_id} has no original work stream")
        layout, raw_id = _locate(names, entry.dead_id)
        group = await _payload_group(client, names, entry)
        counters = await _returnable(client, layout, group)
        new_id = await requeue_dead_letter(
            client, layout, entry.letter.stream, raw_id, entry.letter.payload, limits,
            ticket=group, counters=counters, most=1,
        )
        done.append((entry.dead_id, new_id))
    return done


async def _payload_group(client: RedisClient, names: N.Names, entry: DeadEntry) -> str | None:
    """The training group the letter's payload carries (what goes back in flight), or None:
    an evaluation item, or a payload that does not decode as its stream's message."""
    assert entry.letter is not None
    kind = MESSAGE_OF_STREAM.get(entry.letter.stream)
    if kind is None or entry.letter.stream == N.EVALS:
        return None
    try:
        return training_group(decode(await full_payload(client, names, entry), kind))
    except (LookupError, MessageError):
        return None


async def _returnable(client: RedisClient, layout: N.Names, group: str | None) -> list[str]:
    """The counters a requeue of ``group`` may take back: those the letter that released it
    recorded adding to, that are its shard's failed or resolved counts (what the runtime's
    letters count, runtime.serve.dead_letter, and all the admin role may write)."""
    if group is None:
        return []
    mine = (layout.counter(N.failed_counter("")), layout.counter(N.resolved_counter("")))
    return [k for k in await released_counters(client, layout, group) if k.startswith(mine)]


async def purge(client: RedisClient, names: N.Names, entries: list[DeadEntry]) -> int:
    """Delete exactly these dead letters; returns how many were still there."""
    if not entries:
        return 0
    by_layout: dict[N.Names, list[str]] = {}
    for e in entries:
        layout, raw_id = _locate(names, e.dead_id)
        by_layout.setdefault(layout, []).append(raw_id)
    deleted = 0
    for layout, ids in by_layout.items():
        deleted += await delete_entries(client, layout.stream(N.DEAD), ids)
    return deleted


def _locate(names: N.Names, dead_id: str) -> tuple[N.Names, str]:
    """The layout (shard) a dead letter id belongs to, and its id in that shard's stream."""
    shard, raw_id = split_qualified(dead_id)
    if (shard is None) == names.sharded:
        raise ValueError(f"dead letter id {dead_id!r} does not fit a run of {names.shards} shards")
    return (names if shard is None else names.in_shard(shard)), raw_id


# --------------------------------------------------------------------------- the command


def _print_table(entries: list[DeadEntry]) -> None:
    print(f"{'id':<17}{'stream':<14}{'deliv':>6}{'age':>9}  error")
    for e in entries:
        s = e.summary()
        first = (s["error"] or "").splitlines()[0] if s["error"] else ""
        print(
            f"{s['id']:<17}{s['stream'] or '?':<14}{s['deliveries'] or 0:>6}"
            f"{s['age_s']:>8.0f}s  {first[:100]}"
        )
    print(f"{len(entries)} dead letter(s)")


async def _write_payload(client: RedisClient, names: N.Names, entry: DeadEntry, out: str) -> int:
    try:
        payload = await full_payload(client, names, entry)
    except LookupError as exc:
        print(f"streamrl dlq show --out: {exc}; nothing written", file=sys.stderr)
        return 1
    with open(out, "wb") as f:
        f.write(payload)
    print(f"streamrl dlq show: wrote {len(payload)} bytes of {entry.dead_id}'s payload to {out}",
          file=sys.stderr)
    return 0


async def run_dlq(
    client: RedisClient,
    names: N.Names,
    action: str,
    selection: Selection,
    *,
    as_json: bool = False,
    yes: bool = False,
    limits: PayloadLimits | None = None,
    confirm: Any = input,
    out: str | None = None,
) -> int:
    """The body of ``streamrl dlq ACTION``; returns the exit status. ``out``: ``show``
    also writes the letter's whole payload to this file."""
    if action in ("requeue", "purge", "show") and selection.empty:
        print(f"streamrl dlq {action}: name letter ids, --stream, --error or --all",
              file=sys.stderr)
        return 2
    entries = await list_dead(client, names, selection)
    if out is not None and (action != "show" or len(entries) != 1):
        print(f"streamrl dlq {action} --out: takes `show` of exactly one letter "
              f"({len(entries)} match)", file=sys.stderr)
        return 2
    if action == "list":
        if as_json:
            print(json.dumps([e.summary() for e in entries], indent=2))
        else:
            _print_table(entries)
        return 0
    if action == "show":
        shown = [
            {**e.summary(), "payload": decoded_payload(e.letter) if e.letter else None}
            for e in entries
        ]
        print(json.dumps(shown, indent=2, default=str))
        if out is not None:
            return await _write_payload(client, names, entries[0], out)
        return 0 if entries else 1
    if not entries:
        print(f"streamrl dlq {action}: no dead letter matches", file=sys.stderr)
        return 1
    if action == "requeue":
        for dead_id, new_id in await requeue(client, names, entries, limits):
            print(f"{dead_id} -> {new_id}" if new_id else f"{dead_id}: gone already, skipped")
        return 0
    if action == "purge":
        if not yes:
            _print_table(entries)
            answer = confirm(f"delete these {len(entries)} dead letter(s)? [y/N] ")
            if answer.strip().lower() not in ("y", "yes"):
                print("nothing deleted")
                return 1
        print(f"deleted {await purge(client, names, entries)} dead letter(s)")
        return 0
    raise ValueError(f"unknown dlq action {action!r}")
