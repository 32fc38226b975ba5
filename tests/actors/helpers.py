"""Helpers of the actor tests: tiny learner groups, and a learner made to die mid-step."""

from __future__ import annotations

from streamrl.protocol.messages import Trajectory
from streamrl.testing.messages import make_trajectory

ONE_TINY_STEP = (
    "model.spec=tiny",
    "learner.groups_per_step=2",
    "learner.max_steps=1",
    "queues.block_ms=200",
)
"""Config overrides: a tiny model, one step of two groups."""


def group(rewards: list[float], tokens: list[int] | None = None) -> Trajectory:
    """A group of two samples (``tokens``, default [5, 6]) after the prompt [1, 2, 3]."""
    return make_trajectory([1, 2, 3], [tokens or [5, 6]] * 2, [[-1.0, -1.0]] * 2, rewards)


class Died(Exception):
    """Raised by a test where it makes an actor die."""


def contains_died(exc: BaseException) -> bool:
    """``exc`` is :class:`Died`, or a group that holds one (the nursery's)."""
    if isinstance(exc, BaseExceptionGroup):
        return any(contains_died(e) for e in exc.exceptions)
    return isinstance(exc, Died)
