"""Curriculum domains held back: which domain the scheduler keeps below a difficulty level,
and why, read and written through the broker (:mod:`streamrl.queues.operations`).

- the state is one run-global hash (:attr:`~streamrl.protocol.names.Names.held_back`:
  domain -> :class:`Held`, JSON), written by the scheduler when a domain's reward earned it
  the next level but that level cannot be taken (no usable item: none generates, every
  prompt is too long, none fits the model), read by ``streamrl status``;
- a field is written once per hold; a later hold of the same domain replaces it.
"""

from __future__ import annotations

import time

import msgspec

from streamrl.protocol import names as N
from streamrl.queues.client import RedisClient
from streamrl.queues.operations import read_hash, set_fields


class Held(msgspec.Struct, frozen=True, kw_only=True):
    level: int
    """The level the domain stays at (0-based)."""
    levels: int
    """The levels its curriculum has."""
    reason: str
    """Why the next level was not taken."""
    at: float = 0.0
    """When (unix seconds)."""

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.at))
        return f"at level {self.level} of {self.levels}: {self.reason} (since {when})"


async def hold(client: RedisClient, names: N.Names, domain: str, held: Held) -> None:
    """Record that ``domain`` is held back (the scheduler's). Op: SetFields(held_back)."""
    await set_fields(client, names.held_back, {domain: msgspec.json.encode(held).decode()})


async def held_back(client: RedisClient, names: N.Names) -> dict[str, Held]:
    """The domains held back and why (a field that does not decode: why unknown)."""
    out = {}
    for domain, raw in (await read_hash(client, names.held_back)).items():
        try:
            out[domain] = msgspec.json.decode(raw, type=Held)
        except msgspec.DecodeError:
            out[domain] = Held(level=0, levels=0, reason="unknown (unreadable record)")
    return out
