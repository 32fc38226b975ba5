"""Quarantined domains: which training domains get no new work, and why, read and written
through the broker (:mod:`streamrl.queues.operations`).

- the state is one run-global hash (:attr:`~streamrl.protocol.names.Names.quarantine`:
  domain -> :class:`Why`, JSON), so it survives a scheduler restart and a Redis restart (AOF);
- the scheduler quarantines a domain (:func:`quarantine`) once its policy
  (:class:`streamrl.actors.scheduling.Quarantine`) says it failed too often, and gives it no
  new admissions while its field is there; the operator lifts it (:func:`lift`, ``streamrl
  domains lift``: the field deleted), and the scheduler admits it again;
- the failure counts it reads are the dead-letter script's (``count:failed:<d>``, per stage
  and cause ``count:failed:<d>:<stage>:<cause>``), written with the letters, once per group.
"""

from __future__ import annotations

import time

import msgspec

from streamrl.protocol import names as N
from streamrl.queues.client import RedisClient
from streamrl.queues.operations import delete_fields, read_counters, read_hash, set_fields

STAGES = tuple(N.GROUP_OF_STREAM[s] for s in (*N.UNRESOLVED_STREAMS, N.TRAJECTORIES))
"""The stages whose dead letters count against a domain (not the monitor's: evaluation)."""


class Why(msgspec.Struct, frozen=True, kw_only=True):
    failed: int
    """Failed groups among the ``groups`` last ones when it was quarantined."""
    groups: int
    causes: dict[str, int] = {}
    """``<stage>:<cause>`` -> the domain's failed groups so far (every one, not the window)."""
    at: float = 0.0
    """When (unix seconds)."""

    def describe(self) -> str:
        causes = ", ".join(f"{k.replace(':', ' ')}: {n}" for k, n in
                           sorted(self.causes.items(), key=lambda kv: -kv[1]))
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.at))
        return (f"{self.failed} of its last {self.groups} groups failed"
                + (f" ({causes})" if causes else "") + f", since {when}")


async def counts(client: RedisClient, names: N.Names, counters: list[str]) -> list[int]:
    """Each of ``counters`` summed over the shards (one read per shard)."""
    totals = [0] * len(counters)
    for layout in names.layouts():
        values = await read_counters(client, [layout.counter(c) for c in counters])
        totals = [t + v for t, v in zip(totals, values, strict=True)]
    return totals


async def failed_counts(client: RedisClient, names: N.Names, domains: list[str]) -> dict[str, int]:
    """Failed (dead-lettered) training groups of each of ``domains``."""
    values = await counts(client, names, [N.failed_counter(d) for d in domains])
    return dict(zip(domains, values, strict=True))


async def failure_causes(client: RedisClient, names: N.Names, domain: str) -> dict[str, int]:
    """``<stage>:<cause>`` -> failed groups of ``domain`` (those that happened)."""
    kinds = [(stage, cause) for stage in STAGES for cause in N.FAILURE_CAUSES]
    values = await counts(client, names, [N.failed_counter(domain, s, c) for s, c in kinds])
    return {f"{s}:{c}": n for (s, c), n in zip(kinds, values, strict=True) if n}


async def quarantined(client: RedisClient, names: N.Names) -> dict[str, Why]:
    """The quarantined domains and why (a field that does not decode: why unknown)."""
    out = {}
    for domain, raw in (await read_hash(client, names.quarantine)).items():
        try:
            out[domain] = msgspec.json.decode(raw, type=Why)
        except msgspec.DecodeError:
            out[domain] = Why(failed=0, groups=0)
    return out


async def quarantine(client: RedisClient, names: N.Names, domain: str, why: Why) -> None:
    """Quarantine ``domain`` (the scheduler's). Op: SetFields(quarantine)."""
    await set_fields(client, names.quarantine, {domain: msgspec.json.encode(why).decode()})


async def lift(client: RedisClient, names: N.Names, domains: list[str]) -> list[str]:
    """Lift the quarantine of ``domains`` (the operator's); those that were quarantined. Op:
    DeleteFields(quarantine)."""
    held = await quarantined(client, names)
    lifted = [d for d in domains if d in held]
    await delete_fields(client, names.quarantine, lifted)
    return lifted
