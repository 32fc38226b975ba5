"""streamrl.backoff: exponential backoff with full jitter, and a deadline."""

from __future__ import annotations

import random

import pytest
import trio
import trio.testing

from streamrl.backoff import Backoff, Retrying


def test_delays_double_up_to_the_cap_with_full_jitter() -> None:
    backoff = Backoff(first_s=0.5, max_s=4.0)
    rng = random.Random(7)
    for n, cap in [(1, 0.5), (2, 1.0), (3, 2.0), (4, 4.0), (5, 4.0), (200, 4.0)]:
        delays = [backoff.delay(n, rng) for _ in range(200)]
        assert all(0.0 <= d <= cap for d in delays)
        assert max(delays) > cap * 0.9 and min(delays) < cap * 0.1  # the whole range


async def test_retrying_never_sleeps_past_its_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Given retries bounded to 10 s from the first failure
    retrying = Retrying(Backoff(first_s=1.0, max_s=8.0), timeout_s=10.0, rng=random.Random(1))
    start = trio.current_time()
    # When every try fails
    while not retrying.expired:
        await retrying.wait()
    # Then the last try falls on the deadline, not after it
    assert trio.current_time() - start == pytest.approx(10.0)
    assert retrying.failures >= 3


async def test_reset_starts_the_count_and_the_deadline_over(
    autojump_clock: trio.testing.MockClock,
) -> None:
    retrying = Retrying(Backoff(first_s=1.0, max_s=1.0), timeout_s=2.0, rng=random.Random(3))
    while not retrying.expired:  # (full jitter: how many waits that takes is random)
        await retrying.wait()
    assert retrying.failures >= 2
    retrying.reset()
    assert not retrying.expired and retrying.failures == 0
    assert retrying.failed() <= 1.0 and retrying.deadline == trio.current_time() + 2.0
