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
- ``failed`` / ``causes``: dead-lettered training groups (``count:failed:<d>``) and per
  ``<stage>:<cause>`` (``count:failed:<d>:<stage>:<cause>``), added by the dead-letter script
  once per group (and taken back by ``streamrl dlq requeue``);
- ``backlog``: admitted and not yet resolved (in flight, or dead-lettered on the way);
- ``quarantined``: why the scheduler holds the domain (:mod:`streamrl.protocol.quarantine`),
  None when it does not.
Reads one hash of the tally, the quarantine hash and one MGET per shard, however many
domains.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from streamrl.protocol import names as N
from streamrl.protocol.quarantine import STAGES, Why, counts, quarantined
from streamrl.queues.client import RedisClient
from streamrl.queues.operations import read_tally

KINDS = ("resolved", "trained", "scored", "reward_milli", "failed")
CAUSES = tuple((stage, cause) for stage in STAGES for cause in N.FAILURE_CAUSES)
"""Every ``(stage, cause)`` a training group's dead letter is counted under."""


def counter_names(domain: str) -> tuple[str, ...]:
    """The counters of ``domain``: :data:`KINDS` in order, then each of :data:`CAUSES`."""
    return (f"resolved:{domain}", f"trained:{domain}", f"resolved:{domain}:scored",
            f"resolved:{domain}:reward_milli", N.failed_counter(domain),
            *(N.failed_counter(domain, s, c) for s, c in CAUSES))


@dataclass(frozen=True)
class DomainHealth:
    admitted: int
    resolved: int
    trained: int
    scored: int
    reward_milli: int
    failed: int = 0
    """Dead-lettered training groups (every stage and cause)."""
    causes: dict[str, int] = field(default_factory=dict)
    """``<stage>:<cause>`` -> dead-lettered training groups (those that happened)."""
    quarantined: Why | None = None
    """Why the scheduler gives the domain no new work; None: it does not."""

    @property
    def train_reward(self) -> float | None:
        """Mean reward of the domain's scored training groups (None: none yet)."""
        return self.reward_milli / 1000 / self.scored if self.scored else None

    @property
    def backlog(self) -> int:
        """Admitted groups not resolved yet (in flight, or lost on the way)."""
        return max(0, self.admitted - max(self.resolved, self.scored))

    @property
    def failed_by_stage(self) -> dict[str, int]:
        """Stage -> dead-lettered training groups (those that happened)."""
        out: dict[str, int] = {}
        for kind, n in self.causes.items():
            stage = kind.split(":", 1)[0]
            out[stage] = out.get(stage, 0) + n
        return out


async def domain_health(
    client: RedisClient, names: N.Names, domains: list[str], *, seen: bool = False
) -> dict[str, DomainHealth]:
    """Each of ``domains``' figures, the counters summed over the shards; ``seen``: also every
    domain the run admitted or quarantined (``streamrl status``, whatever config it has)."""
    admitted = await read_tally(client, names.admitted_by_domain)
    held = await quarantined(client, names)
    if seen:
        domains = list(dict.fromkeys([*domains, *sorted(admitted), *sorted(held)]))
    per = len(counter_names(""))
    totals = await counts(client, names, [k for d in domains for k in counter_names(d)])
    out = {}
    for i, d in enumerate(domains):
        values = totals[i * per:(i + 1) * per]
        k = len(KINDS)
        causes = {f"{s}:{c}": n for (s, c), n in zip(CAUSES, values[k:], strict=True) if n}
        resolved, trained, scored, reward_milli, failed = values[:k]
        out[d] = DomainHealth(admitted.get(d, 0), resolved, trained, scored, reward_milli,
                              failed, causes, held.get(d))
    return out
