"""Redis connections for trio code.

redis-py's asyncio client does not run under trio, so every Redis call is the synchronous
client run in a worker thread (``trio.to_thread.run_sync``). Blocking reads get a dedicated
connection each and are cancellable: on cancellation a second connection sends
``CLIENT UNBLOCK`` so the thread returns at once (never ``abandon_on_cancel``, which would
leave a thread reading and swallowing entries).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

import redis
import trio

T = TypeVar("T")


@dataclass(frozen=True)
class RedisURL:
    """``redis://[user:password@]host:port/db``."""

    url: str

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"not a redis URL: {self.redacted}")
        if parts.scheme != "unix" and not parts.hostname:
            raise ValueError(f"redis URL without a host: {self.redacted}")

    @property
    def redacted(self) -> str:
        parts = urlsplit(self.url)
        if parts.password:
            return self.url.replace(f":{parts.password}@", ":***@")
        return self.url

    def with_credentials(self, user: str | None, password: str | None) -> RedisURL:
        if not user and not password:
            return self
        parts = urlsplit(self.url)
        host = parts.hostname or ""
        netloc = f"{user or ''}:{password or ''}@{host}" + (f":{parts.port}" if parts.port else "")
        return RedisURL(parts._replace(netloc=netloc).geturl())


class RedisClient:
    """A pooled synchronous client, used from trio through worker threads."""

    def __init__(self, url: RedisURL | str, *, max_connections: int = 64) -> None:
        self.url = url if isinstance(url, RedisURL) else RedisURL(url)
        self._pool = redis.ConnectionPool.from_url(
            self.url.url, max_connections=max_connections, health_check_interval=30
        )
        self.sync = redis.Redis(connection_pool=self._pool)
        self._limiter = trio.CapacityLimiter(max_connections)

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` (a blocking redis-py call) in a worker thread."""
        return await trio.to_thread.run_sync(
            functools.partial(fn, *args, **kwargs), limiter=self._limiter
        )

    async def execute(self, *args: Any) -> Any:
        return await self.call(self.sync.execute_command, *args)

    def blocking_connection(self) -> BlockingConnection:
        return BlockingConnection(self)

    def close(self) -> None:
        self._pool.disconnect()


class BlockingConnection:
    """One dedicated connection for blocking commands, unblocked on cancellation."""

    def __init__(self, client: RedisClient) -> None:
        self._client = client
        self.sync = redis.Redis.from_url(client.url.url, single_connection_client=True)
        self._id: int | None = None

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if self._id is None:
            self._id = await trio.to_thread.run_sync(self.sync.client_id)
        done = False

        async def unblock_on_cancel() -> None:
            try:
                await trio.sleep_forever()
            finally:
                # The thread may not have reached the blocking call yet: repeat until it returns.
                with trio.CancelScope(shield=True):
                    while not done:
                        await self._client.execute("CLIENT", "UNBLOCK", self._id)
                        await trio.sleep(0.05)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(unblock_on_cancel)
            try:
                result = await trio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))
            finally:
                done = True
                nursery.cancel_scope.cancel()
        return result

    def close(self) -> None:
        self.sync.close()
