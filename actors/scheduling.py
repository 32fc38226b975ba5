"""Sharing the scheduler's capacity across domains: weighted fair queueing with virtual
times, strict priorities, in-flight caps, adaptive re-weighting toward target ratios of
*trained* samples.

Guarantees (of :class:`FairShare`, a pure in-memory policy; the scheduler feeds it counts):
- priorities are strict: a task is taken from a lower priority only when every domain of
  each higher priority is ineligible (at its ``max_inflight`` cap);
- within a priority, weighted fair queueing: each domain has a virtual time, its service
  divided by its weight, and the smallest goes next (ties: registration order), so every
  domain's service stays within about one task of ``weight_i / sum(weights)`` of the total.
  Static (``adaptive=False``) the service is the admitted tasks (classic WFQ: each admission
  advances the domain's virtual finish time by ``1 / weight``). A domain that sat at its
  cap re-enters at the current virtual time (no burst for the time it sat out);
- adaptive re-weighting (``adaptive=True``): the target is a share of the *trained*
  groups, and domains lose groups at different rates (zero reward variance, stale, failed).
  The service counted is then the projected trained groups ``trained + pass * in_flight``
  (``pass``: the domain's fraction of resolved groups that were trained, add-one smoothed),
  i.e. each admission advances the virtual time by ``pass / weight`` -- the effective
  weight is ``weight / pass`` -- and every piece of feedback moves it to what was really
  trained, so a domain that turned out to train less than expected gets the next tasks.
  Bounded: each admitted task is credited at least ``min_pass`` of a trained group, so a
  domain that never trains (the model cannot do it yet) gets at most ``1 / min_pass``
  times its weight's share of the tasks instead of all of them;
- ``pick`` and feedback are O(log n) in the number of domains (a heap per priority level,
  stale entries dropped lazily);
- a quarantined domain (:meth:`FairShare.exclude`) is skipped as if at its cap: its share
  goes to the others, and once let back in it re-enters at the current virtual time.

Also here, as pure policies the scheduler applies: which item of a domain comes next
(:class:`EpochOrder`: epochs without replacement, seeded) and when a domain with difficulty
levels moves up (:func:`next_level`, :class:`Climb`: its recent train reward passed the
configured threshold), and when a domain fails too often to be given more work
(:class:`Quarantine`: ``after`` of its last ``window`` groups dead-lettered).
"""

from __future__ import annotations

import hashlib
import heapq
import random
from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Share:
    name: str
    weight: float = 1.0
    priority: int = 0
    max_inflight: int = 0  # 0: no cap

    def __post_init__(self) -> None:
        if not self.weight > 0:
            raise ValueError(f"domain {self.name!r}: weight must be > 0")
        if self.max_inflight < 0:
            raise ValueError(f"domain {self.name!r}: max_inflight must be >= 0")


@dataclass
class _State:
    share: Share
    order: int
    admitted: int = 0
    resolved: int = 0
    trained: int = 0
    offset: float = 0.0  # lifts the virtual time of a domain that re-enters after its cap
    stamp: int = 0  # the heap entry with this stamp is the live one
    held: bool = False  # skipped at its cap since it was last chosen

    @property
    def inflight(self) -> int:
        return max(0, self.admitted - self.resolved)

    @property
    def pass_rate(self) -> float:
        return (self.trained + 1) / (self.resolved + 1)


@dataclass(frozen=True)
class DomainStats:
    admitted: int
    resolved: int
    trained: int
    target_ratio: float
    trained_ratio: float
    effective_weight: float


class FairShare:
    def __init__(self, shares: list[Share], *, adaptive: bool = True,
                 min_pass: float = 0.1) -> None:
        if not shares:
            raise ValueError("at least one domain is needed")
        names = [s.name for s in shares]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate domains in {names}")
        self.shares = list(shares)
        self.adaptive = adaptive
        if not 0 < min_pass <= 1:
            raise ValueError("min_pass must be in (0, 1]")
        self.min_pass = min_pass
        self._states = {s.name: _State(s, i) for i, s in enumerate(shares)}
        total = sum(s.weight for s in shares)
        self._target = {s.name: s.weight / total for s in shares}
        self._heaps: dict[int, list[tuple[float, int, int, str]]] = {}
        self._vtime: dict[int, float] = {}
        for st in self._states.values():
            self._heaps.setdefault(st.share.priority, []).append((0.0, st.order, 0, st.share.name))
            self._vtime[st.share.priority] = 0.0
        for heap in self._heaps.values():
            heapq.heapify(heap)
        self._levels = sorted(self._heaps, reverse=True)
        self.excluded: frozenset[str] = frozenset()
        self.caps: dict[str, int] = {}

    def exclude(self, names: set[str] | frozenset[str]) -> None:
        """Give ``names`` no tasks (quarantined) until excluded no more; the others share
        their capacity."""
        self.excluded = frozenset(names)

    def limit(self, caps: dict[str, int]) -> None:
        """In-flight caps on top of the shares' own (on probation: :meth:`Quarantine.caps`)."""
        self.caps = caps

    def _capped(self, st: _State) -> bool:
        caps = [c for c in (st.share.max_inflight, self.caps.get(st.share.name, 0)) if c]
        return bool(caps) and st.inflight >= min(caps)

    def _service(self, st: _State) -> float:
        if self.adaptive:
            projected = st.trained + max(self.min_pass, st.pass_rate) * st.inflight
            return max(projected, self.min_pass * st.admitted)
        return float(st.admitted)

    def _vt(self, st: _State) -> float:
        return st.offset + self._service(st) / st.share.weight

    def _push(self, st: _State) -> None:
        st.stamp += 1
        heap = self._heaps[st.share.priority]
        heapq.heappush(heap, (self._vt(st), st.order, st.stamp, st.share.name))

    # -- the policy ---------------------------------------------------------------------
    def pick(self) -> str | None:
        """The domain of the next task (counted as admitted); None if every domain is at
        its in-flight cap."""
        for level in self._levels:
            heap, held = self._heaps[level], []
            chosen: _State | None = None
            while heap:
                entry = heapq.heappop(heap)
                st = self._states[entry[3]]
                if entry[2] != st.stamp:
                    continue  # superseded by a newer entry
                if self._capped(st) or st.share.name in self.excluded:
                    st.held = True
                    held.append(entry)
                    continue
                chosen = st
                break
            for entry in held:
                heapq.heappush(heap, entry)
            if chosen is None:
                continue
            now = self._vtime[level]
            if chosen.held and self._vt(chosen) < now:  # back from its cap: start at now
                chosen.offset += now - self._vt(chosen)
            chosen.held = False
            self._vtime[level] = max(now, self._vt(chosen))
            chosen.admitted += 1
            self._push(chosen)
            return chosen.share.name
        return None

    def resolved(self, name: str, trained: bool, groups: int = 1) -> None:
        """Feedback: ``groups`` of ``name`` left the pipeline, trained or not."""
        st = self._states[name]
        st.resolved += groups
        st.trained += groups if trained else 0
        self._push(st)

    def observe(self, resolved: dict[str, int], trained: dict[str, int]) -> None:
        """Feedback as cumulative counts (e.g. read from Redis counters)."""
        for name, st in self._states.items():
            r, t = max(st.resolved, resolved.get(name, 0)), max(st.trained, trained.get(name, 0))
            if (r, t) != (st.resolved, st.trained):
                st.resolved, st.trained = r, t
                self._push(st)

    # -- observation --------------------------------------------------------------------
    def statistics(self) -> dict[str, DomainStats]:
        trained_total = sum(st.trained for st in self._states.values()) or 1
        return {
            name: DomainStats(
                admitted=st.admitted,
                resolved=st.resolved,
                trained=st.trained,
                target_ratio=self._target[name],
                trained_ratio=st.trained / trained_total,
                effective_weight=st.share.weight
                / (max(self.min_pass, st.pass_rate) if self.adaptive else 1.0),
            )
            for name, st in self._states.items()
        }


# -- which item next: epochs without replacement ---------------------------------------------


def stable_seed(*parts: object) -> int:
    """A seed from ``parts`` that is the same in every process (not Python's salted hash)."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "big")


class EpochOrder:
    """Indices ``0..n-1`` in a fresh seeded shuffle per epoch: within an epoch no item is
    drawn twice, and every item is drawn once before any is drawn again."""

    def __init__(self, n: int, seed: int) -> None:
        if n < 1:
            raise ValueError("no items to draw from")
        self.n = n
        self.epoch = 0
        self._rng = random.Random(seed)
        self._order: list[int] = []

    def next(self) -> int:
        if not self._order:
            self._order = list(range(self.n))
            self._rng.shuffle(self._order)
            self._order.reverse()  # pop() from the end: the shuffle's order, first to last
            self.epoch += 1
        return self._order.pop()


# -- difficulty curriculum ---------------------------------------------------------------------


def next_level(level: int, levels: int, groups: int, reward_sum: float, *,
               threshold: float, min_groups: int) -> int:
    """The curriculum level after observing ``groups`` train groups at ``level`` whose mean
    rewards sum to ``reward_sum``: one up when at least ``min_groups`` were seen and their
    mean reward reached ``threshold`` (and a level above exists), else the same. Never
    down: a level once passed stays passed."""
    if threshold <= 0 or level + 1 >= levels or groups < min_groups or groups <= 0:
        return level
    return level + 1 if reward_sum / groups >= threshold else level


@dataclass
class Climb:
    """One domain's place on its curriculum: the level and the cumulative counts (groups,
    reward sum) at which it started, so only groups resolved at this level count."""

    levels: int
    threshold: float
    min_groups: int
    level: int = 0
    base_groups: int = 0
    base_reward: float = 0.0

    def observe(self, groups: int, reward_sum: float) -> bool:
        """Feed cumulative counts; True when the domain moved up a level."""
        new = next_level(self.level, self.levels, groups - self.base_groups,
                         reward_sum - self.base_reward, threshold=self.threshold,
                         min_groups=self.min_groups)
        if new == self.level:
            return False
        self.level, self.base_groups, self.base_reward = new, groups, reward_sum
        return True


def reward_counters(domain: str) -> tuple[str, str]:
    """The run counters a curriculum reads for ``domain``: train groups scored, and the sum
    of their mean rewards in thousandths (integers, added by the verifier's hand-off with
    ``runtime.serve.Count``; under ``resolved:`` so the scheduler's grant reads them)."""
    return f"resolved:{domain}:scored", f"resolved:{domain}:reward_milli"


# -- quarantine --------------------------------------------------------------------------------


@dataclass
class _Recent:
    """One domain's outcomes of its last groups (True: failed) and the counts seen last."""

    outcomes: deque[bool]
    resolved: int | None = None
    failed: int = 0


@dataclass
class Quarantine:
    """Which domains failed too often to get more work: ``after`` or more of their last
    ``window`` resolved groups dead-lettered (0: never). Fed cumulative counts (the
    per-domain ``resolved:<d>`` and ``failed:<d>`` counters); the first counts seen of a
    domain are its baseline (what failed before this scheduler started does not count: a
    lifted domain is not quarantined again by its old failures). Between two observations
    the order is unknown: the new failures are taken as the newest groups (the verdict comes
    no later than it would in order)."""

    after: int
    window: int
    _recent: dict[str, _Recent] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.after > self.window:
            raise ValueError(f"quarantine after {self.after} failures of the last "
                             f"{self.window} groups can never happen")

    def observe(self, resolved: dict[str, int], failed: dict[str, int]) -> list[str]:
        """Feed cumulative counts; the domains now past the threshold."""
        due = []
        for name, total in resolved.items():
            r = self._recent.setdefault(name, _Recent(deque(maxlen=self.window)))
            fails = failed.get(name, 0)
            if r.resolved is None:  # baseline
                r.resolved, r.failed = total, fails
                continue
            new_failed = max(0, fails - r.failed)
            # a letter after the verifier (the learner's) fails a group resolved already
            new_ok = max(0, total - r.resolved - new_failed)
            r.outcomes.extend([False] * min(new_ok, self.window))
            r.outcomes.extend([True] * min(new_failed, self.window))
            r.resolved, r.failed = max(r.resolved, total), max(r.failed, fails)
            if self.after and sum(r.outcomes) >= self.after:
                due.append(name)
        return due

    def recent(self, name: str) -> tuple[int, int]:
        """(failed, groups) among ``name``'s last ``window`` groups."""
        r = self._recent.get(name)
        return (sum(r.outcomes), len(r.outcomes)) if r else (0, 0)

    def caps(self) -> dict[str, int]:
        """In-flight caps of the domains on probation (a failure among their last ``window``
        groups): ``window - failures``, so a domain that fails every group is quarantined
        within ``window`` of its groups admitted after its first failure was seen."""
        if not self.after:
            return {}
        return {name: max(1, self.window - n) for name, r in self._recent.items()
                if (n := sum(r.outcomes))}

    def reset(self, name: str) -> None:
        """Forget ``name``'s recent outcomes (lifted: it starts over from its counts now)."""
        if (r := self._recent.get(name)) is not None:
            r.outcomes.clear()
