"""``wait_until``: wait for a condition in a test, instead of a hand-written poll loop."""

from __future__ import annotations

import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio

T = TypeVar("T")


async def wait_until(
    predicate: Callable[[], T | Awaitable[T]], timeout: float = 10.0, interval: float = 0.05
) -> T:
    """Until ``predicate()`` (awaited when it returns an awaitable) is truthy; its value.
    ``trio.TooSlowError`` after ``timeout`` seconds."""
    with trio.fail_after(timeout):
        while True:
            value = predicate()
            if inspect.isawaitable(value):
                value = await value
            if value:
                return value  # type: ignore[return-value]
            await trio.sleep(interval)


def wait_until_sync(predicate: Callable[[], T], timeout: float = 10.0, interval: float = 0.1) -> T:
    """:func:`wait_until` outside trio (blocks the thread); ``TimeoutError`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() >= deadline:
            raise TimeoutError(f"condition not met within {timeout} s")
        time.sleep(interval)
    return value
