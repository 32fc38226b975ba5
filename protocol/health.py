"""Per-domain figures of a run, read through the broker: what ``streamrl status`` lists per
domain and what the summary of ``streamrl up`` holds under ``domains``.

Every figure is a counter written by the atomic step that causes it, so none double counts:
- ``admitted``: training groups the scheduler admitted (the admission script's tally,
  :attr:`~streamrl.protocol.names.Names.admitted_by_domain`, with the run's ``admitted``);
- ``resolved`` / ``trained``: groups the verifier scored / forwarded to the learner
  (``count:resolved:<d>``, ``count:trained:<d>``, dynamic sampling's counters), and
  ``scored`` / ``reward_milli`` (``count:resolved:<d>:scored``, ``...:reward_milli``: every
  scored training group and the sum of its mean reward in thousandths), so ``train_reward``
  is the mean reward of the domain's scored training groups;
- ``backlog``: admitted and not yet resolved (in flight, or dead-lettered on the way).
Reads one hash and one MGET per shard, however many domains.
"""

from __future__ import annotations

from dataclasses import dataclass

from streamrl.protocol import names as N
from streamrl.queues.client import RedisClient
from streamrl.queues.operations import read_counters, read_tally

KINDS = ("resolved", "trained", "scored", "reward_milli")


def counter_names(domain: str) -> tuple[str, ...]:
    """The verifier's counters of ``domain``, in :data:`KINDS` order."""
    return (f"resolved:{domain}", f"trained:{domain}", f"resolved:{domain}:scored",
            f"resolved:{domain}:reward_milli")


@dataclass(frozen=True)
class DomainHealth:
    admitted: int
    resolved: int
    trained: int
    scored: int
    reward_milli: int

    @property
    def train_reward(self) -> float | None:
        """Mean reward of the domain's scored training groups (None: none yet)."""
        return self.reward_milli / 1000 / self.scored if self.scored else None

    @property
    def backlog(self) -> int:
        """Admitted groups not resolved yet (in flight, or lost on the way)."""
        return max(0, self.admitted - max(self.resolved, self.scored))


async def domain_health(
    client: RedisClient, names: N.Names, domains: list[str]
) -> dict[str, DomainHealth]:
    """Each of ``domains``' figures, the counters summed over the shards."""
    admitted = await read_tally(client, names.admitted_by_domain)
    keys = [name for d in domains for name in counter_names(d)]
    totals = [0] * len(keys)
    for layout in names.layouts():  # one MGET per shard, in its slot
        values = await read_counters(client, [layout.counter(k) for k in keys])
        totals = [t + v for t, v in zip(totals, values, strict=True)]
    k = len(KINDS)
    return {
        d: DomainHealth(admitted.get(d, 0), *totals[i * k:(i + 1) * k])
        for i, d in enumerate(domains)
    }
