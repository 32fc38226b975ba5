"""Waiting in tests for an event, never for the clock: ``wait_until`` (a condition, polled
until true), ``deadline`` (a bound on any wait); each fails with what did not happen."""

from __future__ import annotations

import inspect
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import trio

T = TypeVar("T")


async def wait_until(
    predicate: Callable[[], T | Awaitable[T]],
    timeout: float = 10.0,
    interval: float = 0.05,
    *,
    what: str = "",
) -> T:
    """Until ``predicate()`` (awaited when it returns an awaitable) is truthy; its value.
    ``trio.TooSlowError`` after ``timeout`` seconds, saying ``what`` did not happen."""
    with deadline(timeout, what or "the condition was not met"):
        while True:
            value = predicate()
            if inspect.isawaitable(value):
                value = await value
            if value:
                return value  # type: ignore[return-value]
            await trio.sleep(interval)


@contextmanager
def deadline(seconds: float, what: str) -> Iterator[trio.CancelScope]:
    """``trio.fail_after(seconds)`` whose ``TooSlowError`` says ``what`` did not happen in
    time. Give a wait several times what it takes, and well below what a hang would take."""
    try:
        with trio.fail_after(seconds) as scope:
            yield scope
    except trio.TooSlowError:
        raise trio.TooSlowError(f"{what} (not within {seconds} s)") from None


def wait_until_sync(
    predicate: Callable[[], T], timeout: float = 10.0, interval: float = 0.1, *, what: str = ""
) -> T:
    """:func:`wait_until` outside trio (blocks the thread); ``TimeoutError`` after ``timeout``."""
    end = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() >= end:
            raise TimeoutError(f"{what or 'condition not met'} (not within {timeout} s)")
        time.sleep(interval)
    return value
