"""Exponential backoff with full jitter: the one way this package waits between retries.

``Backoff(first_s, max_s).delay(n)`` is the wait before the ``n``-th retry (1-based): uniform
in ``[0, min(max_s, first_s * 2 ** (n - 1))]`` (AWS's "full jitter", so that replicas failing
together do not retry together). :class:`Retrying` keeps the count for one loop of retries,
starts over after a success and, given a ``timeout_s``, never sleeps past the deadline set
at the first failure (the last try falls on it). Imports nothing of the package, so every
folder may use it (the broker's reconnects, the runtime's retry policy, the sandbox pools).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import trio


@dataclass(frozen=True)
class Backoff:
    first_s: float = 0.5
    max_s: float = 30.0

    def delay(self, n: int, rng: random.Random | None = None) -> float:
        """The wait before the ``n``-th retry (1-based), with full jitter."""
        cap = min(self.max_s, self.first_s * 2 ** min(max(n - 1, 0), 64))
        return (rng or random).uniform(0, cap)


class Retrying:
    """The retries of one operation: ``await retrying.wait()`` after each failure,
    ``retrying.reset()`` after a success. With ``timeout_s``, :attr:`expired` says whether
    the deadline (``timeout_s`` after the first failure since the last reset) has passed."""

    def __init__(
        self, backoff: Backoff, timeout_s: float | None = None, rng: random.Random | None = None
    ) -> None:
        self.backoff = backoff
        self.timeout_s = math.inf if timeout_s is None else timeout_s
        self.rng = rng
        self.failures = 0
        self.deadline = math.inf

    def failed(self) -> float:
        """Count a failure; the wait before the next try (up to the deadline)."""
        now = trio.current_time()
        if self.failures == 0:
            self.deadline = now + self.timeout_s
        self.failures += 1
        return max(0.0, min(self.backoff.delay(self.failures, self.rng), self.deadline - now))

    @property
    def expired(self) -> bool:
        return trio.current_time() >= self.deadline

    async def wait(self) -> None:
        """Count a failure and sleep until the next try."""
        await trio.sleep(self.failed())

    def reset(self) -> None:
        self.failures = 0
        self.deadline = math.inf
