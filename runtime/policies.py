"""The policies the runtime applies around every ``handle`` call, each in one place.

- :class:`RetryPolicy`: a handler that raises is retried in-process with exponential
  backoff and full jitter; past ``max_retries`` the message is dead-lettered with the error.
  A handler may ask for a specific delay by raising :class:`Retry`.
- :class:`Unavailable`: a :class:`Retry` for infrastructure this process cannot reach (sandbox
  engine down): retried in-process the same way, but past ``max_retries`` the message is
  released (left pending, no longer heart-beaten) instead of dead-lettered, so the reclaimer
  of any replica redelivers it later; the delivery limit still bounds it.
- :class:`Reject`: the handler found the input itself invalid: dead-letter now, no retry.
- delivery limit: a message delivered more than ``queues.max_deliveries`` times (the process
  handling it died each time) is dead-lettered before it is handled again. The consumer
  applies it (:attr:`queues.streams.ConsumerSettings.max_deliveries`), before any of the
  payload is fetched; the runtime dead-letters what it refused
  (:func:`runtime.serve.decode_or_dead_letter`).
- time limit: ``handle`` runs under ``trio.fail_after``; running over counts as a failure.
Actors contain none of this bookkeeping.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from streamrl.backoff import Backoff


class Retry(Exception):
    """Raised by a handler to be retried after ``delay`` seconds (None: the policy's backoff)."""

    def __init__(self, reason: str = "", delay: float | None = None) -> None:
        super().__init__(reason)
        self.delay = delay


class Unavailable(Retry):
    """Raised by a handler when infrastructure it needs is down: retried, then released."""


class Reject(Exception):
    """Raised by a handler when the message can never succeed: it is dead-lettered at once,
    its error ``<cause>: <reason>`` and its group counted under ``cause``
    (:data:`streamrl.protocol.names.FAILURE_CAUSES`)."""

    cause = "rejected"


@dataclass(frozen=True)
class RetryPolicy:
    max_retries: int = 3
    backoff_s: float = 0.5
    max_backoff_s: float = 30.0

    def delay(self, retry: int, rng: random.Random | None = None) -> float:
        """Full-jitter exponential backoff for the ``retry``-th retry (1-based)."""
        return Backoff(self.backoff_s, self.max_backoff_s).delay(retry, rng)


@dataclass(frozen=True)
class Policies:
    retry: RetryPolicy = RetryPolicy()
    time_limit_s: float = 600.0
