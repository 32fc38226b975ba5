"""Scheduling across domains: weighted fair queueing, priorities, in-flight caps, adaptive
re-weighting toward trained ratios; the verifier's dynamic sampling (zero-variance skip)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from streamrl.actors.executor import to_outcome
from streamrl.actors.scheduler import make_task
from streamrl.actors.scheduling import FairShare, Share
from streamrl.actors.verifier import Verifier
from streamrl.domains.math import MathItem
from streamrl.protocol import names as N
from streamrl.protocol.messages import Executed, Rollout, Sample, Sampling, Trajectory, new_id, now
from streamrl.runtime.serve import Count, Output


def test_wfq_admits_in_proportion_to_weights_in_every_window() -> None:
    fair = FairShare([Share("a", 1), Share("b", 2), Share("c", 5)], adaptive=False)
    picks = [fair.pick() for _ in range(800)]
    assert Counter(picks) == {"a": 100, "b": 200, "c": 500}
    for start in range(0, 800 - 80, 37):  # any window: within one task of proportional
        window = Counter(picks[start : start + 80])
        for name, w in (("a", 1), ("b", 2), ("c", 5)):
            assert abs(window[name] - 80 * w / 8) <= 1.5


def test_priority_is_strict_and_caps_release_lower_levels() -> None:
    fair = FairShare([Share("hi", 1, priority=1, max_inflight=3), Share("lo", 1)],
                     adaptive=False)
    assert [fair.pick() for _ in range(5)] == ["hi", "hi", "hi", "lo", "lo"]
    fair.resolved("hi", trained=True, groups=2)  # two slots free again
    assert [fair.pick() for _ in range(3)] == ["hi", "hi", "lo"]


def test_all_capped_gives_none_and_a_late_reentry_gets_no_burst() -> None:
    fair = FairShare([Share("a", 1, max_inflight=1), Share("b", 1)], adaptive=False)
    assert fair.pick() == "a"
    for _ in range(50):
        assert fair.pick() == "b"
    fair.resolved("a", trained=True)
    picks = [fair.pick() for _ in range(10)]
    assert picks.count("a") == 1  # capped at one in flight: no catching up on b
    only = FairShare([Share("x", 1, max_inflight=1)], adaptive=False)
    assert only.pick() == "x" and only.pick() is None


def simulate(adaptive: bool, tasks: int = 6000, lag: int = 32) -> dict[str, float]:
    """Domains with different skip rates (zero-variance groups); returns trained ratio /
    target ratio per domain."""
    rng = random.Random(3)
    skip = {"a": 0.0, "b": 0.5, "c": 0.8}
    fair = FairShare([Share("a", 1), Share("b", 1), Share("c", 2)], adaptive=adaptive)
    pipeline: list[str] = []
    for _ in range(tasks):
        name = fair.pick()
        assert name is not None
        pipeline.append(name)
        if len(pipeline) > lag:
            done = pipeline.pop(0)
            fair.resolved(done, trained=rng.random() >= skip[done])
    return {n: s.trained_ratio / s.target_ratio for n, s in fair.statistics().items()}


def test_adaptive_reweighting_reaches_the_trained_targets() -> None:
    static, adaptive = simulate(False), simulate(True)
    assert max(abs(r - 1) for r in static.values()) > 0.5  # skips distort the mix...
    assert max(abs(r - 1) for r in adaptive.values()) < 0.05  # ...re-weighting corrects it


def test_bad_shares_are_refused() -> None:
    with pytest.raises(ValueError):
        Share("a", 0)
    with pytest.raises(ValueError):
        FairShare([Share("a"), Share("a")])
    with pytest.raises(ValueError):
        FairShare([])


ITEM = MathItem(id="m", prompt="What is 2+2?", answer="4", kind="t")


def executed(texts: list[str], split: str = "train") -> Executed:
    task = make_task("math", ITEM, split=split, group_size=len(texts), sampling=Sampling(),
                     version=0)
    samples = [Sample(tokens=b"\0\0\0\0", logprobs=b"\0\0\0\0", text=t, finish_reason="stop",
                      weight_version=0) for t in texts]
    rollout = Rollout(id=new_id(), created_at=now(), policy_version=0, task=task,
                      prompt_ids=b"\0\0\0\0", samples=samples)
    return Executed(id=new_id(), created_at=now(), policy_version=0, rollout=rollout,
                    outcomes=[to_outcome(None) for _ in texts])


async def test_dynamic_sampling_skips_and_counts_zero_variance_groups() -> None:
    counts: Counter[str] = Counter()

    async def handle(verifier: Verifier, group: Executed) -> list[Output]:
        """The outputs; the counters (added by the hand-off) tallied in ``counts``."""
        results = await verifier.handle(group)
        counts.update({r.name: r.n for r in results if isinstance(r, Count)})
        return [r for r in results if isinstance(r, Output)]

    verifier = Verifier(dynamic_sampling=True)
    # Given a group that is all right and one that is all wrong: no signal, skipped
    assert await handle(verifier, executed(["Answer: 4", "Answer: 4"])) == []
    assert await handle(verifier, executed(["Answer: 5", "nothing"])) == []
    # And a mixed group: forwarded to the learner
    out = await handle(verifier, executed(["Answer: 4", "Answer: 5"]))
    assert [o.stream for o in out] == [N.TRAJECTORIES]
    assert isinstance(out[0].message, Trajectory) and out[0].message.rewards == [1.0, 0.0]
    # (every scored group, skipped or not, counts with its mean reward: the curriculum's and
    # the summary's train reward; 1.0 + 0.0 + 0.5 = 1.5 in thousandths)
    assert counts == {"zero_variance": 2, "resolved:math": 3, "trained:math": 1,
                      "resolved:math:scored": 3, "resolved:math:reward_milli": 1500}
    # Evaluation groups are never skipped nor counted
    out = await handle(verifier, executed(["Answer: 4"], split="eval"))
    assert [o.stream for o in out] == [N.EVALS] and counts["resolved:math"] == 3
    # Without dynamic sampling a zero-variance group goes through (resolved and trained)
    out = await Verifier().handle(executed(["Answer: 4", "Answer: 4"]))
    assert [type(r) for r in out if isinstance(r, Output)] == [Output]
    assert {"resolved:math", "trained:math"} <= {r.name for r in out if isinstance(r, Count)}


def test_a_domain_that_never_trains_cannot_take_all_the_capacity() -> None:
    fair = FairShare([Share("hopeless", 1), Share("ok", 1)], adaptive=True, min_pass=0.25)
    for _ in range(2000):
        name = fair.pick()
        assert name is not None
        fair.resolved(name, trained=name == "ok")
    admitted = {n: s.admitted for n, s in fair.statistics().items()}
    assert admitted["hopeless"] <= 4.2 * admitted["ok"]  # at most 1/min_pass times its share
    assert admitted["ok"] >= 2000 / 5.2
