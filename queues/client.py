"""Redis connections for trio code, to one Redis server or to a Redis Cluster.

redis-py's asyncio client does not run under trio, so every Redis call is the synchronous
client run in a worker thread (``trio.to_thread.run_sync``). Blocking reads get a dedicated
connection each and are cancellable: on cancellation a second connection sends
``CLIENT UNBLOCK`` so the thread returns at once (never ``abandon_on_cancel``, which would
leave a thread reading and swallowing entries).

Redis Cluster (``redis+cluster://`` URLs) is used through the same API: ``RedisClient.sync``
is then a :class:`redis.cluster.RedisCluster`, which routes each command to the node owning
its keys' slot. Every call the queue layer makes touches keys of one slot (see
:mod:`protocol.names`), so it runs there unchanged. A blocking connection is opened to the
primary owning the slot of the key it blocks on, and ``CLIENT UNBLOCK`` goes to that node.

The hot path (a consumer's read and its batched hand-off script) skips redis-py's per-argument
command packing and reply callbacks: :func:`encode_command` writes the RESP request in one
pass, :func:`execute_encoded` sends it on a pooled connection and returns the reply as the
parser gives it, and :func:`run_script` adds redis-py's ``Script`` behaviour (EVALSHA, loaded
again on NOSCRIPT). They take a plain :class:`redis.Redis` (one server, or one node of a
cluster); a cluster client keeps redis-py's own path, which routes and follows MOVED.

Transient connection errors (Redis restarting or loading its AOF, a dropped connection, a
cluster re-electing) do not surface at once: every call is retried with exponential backoff
and full jitter (:mod:`streamrl.backoff`), logged, for up to :attr:`Reconnect.timeout_s`, then
raised. Every call the queue layer makes is safe to repeat after a lost reply: reads,
acknowledgements, claims, and scripts guarded by a dedup key or a compare-and-set. A lost
reply to a read costs no entry: entries delivered to a consumer stay in its pending list
until reclaimed.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast
from urllib.parse import urlsplit, urlunsplit

import redis
import structlog
import trio
from redis.cluster import ClusterNode, RedisCluster

from streamrl.backoff import Backoff, Retrying

T = TypeVar("T")

log = structlog.get_logger()

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
"""Cluster URL scheme -> the plain scheme of one node's URL (same credentials, same TLS)."""


@dataclass(frozen=True)
class RedisURL:
    """``redis://[user:password@]host:port/db``, or for Redis Cluster
    ``redis+cluster://[user:password@]host:port[,host:port...]`` (``rediss+cluster`` for TLS):
    one or more seed nodes, the client discovers the rest; a cluster has only db 0."""

    url: str

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme in CLUSTER_SCHEMES:
            if parts.path not in ("", "/", "/0"):
                raise ValueError(f"a Redis Cluster has only db 0: {self.redacted}")
            self.seeds  # noqa: B018  (validates the host list)
            return
        if parts.scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"not a redis URL: {self.redacted}")
        if parts.scheme != "unix" and not parts.hostname:
            raise ValueError(f"redis URL without a host: {self.redacted}")

    @property
    def cluster(self) -> bool:
        return urlsplit(self.url).scheme in CLUSTER_SCHEMES

    @property
    def seeds(self) -> list[tuple[str, int]]:
        """The (host, port) of every node named in a cluster URL."""
        hosts = urlsplit(self.url).netloc.rpartition("@")[2]
        seeds = []
        for item in hosts.split(","):
            node = urlsplit(f"//{item.strip()}")
            if not node.hostname:
                raise ValueError(f"cluster URL with an empty host: {self.redacted}")
            seeds.append((node.hostname, node.port or 6379))
        return seeds

    def node_url(self, host: str, port: int) -> RedisURL:
        """The plain URL of one node of this cluster: same credentials, TLS and options."""
        parts = urlsplit(self.url)
        userinfo, at, _ = parts.netloc.rpartition("@")
        address = f"[{host}]" if ":" in host else host
        netloc = f"{userinfo}{at}{address}:{port}"
        return RedisURL(urlunsplit((CLUSTER_SCHEMES[parts.scheme], netloc, "", parts.query, "")))

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
        hosts = parts.netloc.rpartition("@")[2]
        netloc = f"{user or ''}:{password or ''}@{hosts}"
        return RedisURL(parts._replace(netloc=netloc).geturl())

    def without_credentials(self) -> RedisURL:
        parts = urlsplit(self.url)
        return RedisURL(parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl())


Arg = bytes | str | int | float
"""An argument of an encoded command."""


def encode_command(args: Sequence[Arg]) -> bytes:
    """The RESP request for the command ``args``, as redis-py encodes it (str as UTF-8, an int
    in decimal, a float as its ``repr``; a bool is refused), built in one pass: redis-py calls
    its encoder once per argument and packs through hiredis, several times slower for a
    script call that carries hundreds of payloads."""
    parts = [b"*%d\r\n" % len(args)]
    append = parts.append
    for arg in args:
        if isinstance(arg, str):
            arg = arg.encode()
        elif not isinstance(arg, bytes):
            if isinstance(arg, bool) or not isinstance(arg, int | float):
                raise TypeError(f"cannot encode {type(arg).__name__} as a Redis argument")
            arg = b"%d" % arg if isinstance(arg, int) else repr(arg).encode()
        append(b"$%d\r\n" % len(arg))
        append(arg)
        append(b"\r\n")
    return b"".join(parts)


def execute_encoded(sync: redis.Redis, command: bytes) -> Any:
    """Send ``command`` (:func:`encode_command`) on a connection of ``sync``'s pool; return
    its reply as the parser gives it (no response callback: RESP3 maps stay dicts). An error
    reply raises as with redis-py; a connection error closes the connection and raises (the
    caller's :func:`with_reconnect` retries on a new one)."""
    pool = sync.connection_pool
    conn = pool.get_connection()
    try:
        conn.send_packed_command([command])
        return conn.read_response()
    except (redis.ConnectionError, redis.TimeoutError):
        conn.disconnect()
        raise
    finally:
        pool.release(conn)


def run_script(script: Any, sync: redis.Redis, keys: Sequence[Arg], args: Sequence[Arg]) -> Any:
    """``script(keys=keys, args=args)`` (a script of ``register_script``) through
    :func:`execute_encoded`: EVALSHA, and on NOSCRIPT (a server restarted, or one that never
    saw it) SCRIPT LOAD and EVALSHA again, as redis-py's ``Script`` does."""
    head: list[Arg] = ["EVALSHA", script.sha, len(keys)]
    try:
        return execute_encoded(sync, encode_command([*head, *keys, *args]))
    except redis.exceptions.NoScriptError:
        script.sha = sync.script_load(script.script)
        head[1] = script.sha
        return execute_encoded(sync, encode_command([*head, *keys, *args]))


class _ClusterClient(RedisCluster):
    """A RedisCluster whose pipelines can also run registered scripts.

    redis-py refuses EVALSHA in cluster pipelines (it could not reload a script that a
    restarted node forgot); here a script queued on a pipeline is sent as EVAL with its
    text. Outside pipelines scripts run as usual (EVALSHA, reloaded on NOSCRIPT).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._script_texts: dict[str, Any] = {}

    def register_script(self, script: Any) -> Any:
        registered = super().register_script(script)
        self._script_texts[registered.sha] = registered.script
        return registered

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> Any:
        pipe = super().pipeline(transaction, shard_hint)
        texts = self._script_texts

        def evalsha(sha: str, numkeys: int, *keys_and_args: Any) -> Any:
            return pipe.execute_command("EVAL", texts[sha], numkeys, *keys_and_args)

        pipe.evalsha = evalsha
        return pipe


TRANSIENT_ERRORS: tuple[type[Exception], ...] = (
    redis.ConnectionError,  # refused, reset, closed; also LOADING (BusyLoadingError)
    redis.TimeoutError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
)


@dataclass(frozen=True)
class Reconnect:
    """How long calls wait for an unreachable Redis before raising, and how they back off."""

    timeout_s: float = 60.0
    backoff_s: float = 0.1
    max_backoff_s: float = 2.0


async def with_reconnect(
    attempt: Callable[[], Awaitable[T]],
    policy: Reconnect,
    what: str,
    on_error: Callable[[], None] | None = None,
) -> T:
    """``await attempt()``, repeated with backoff on transient connection errors until
    ``policy.timeout_s`` has passed since the first failure; then the error is raised.

    A refused password (``AuthenticationError``) counts as transient too: Redis restarted
    without the run's ACL users refuses them until they are created again. ``on_error``
    runs before each retry (e.g. to forget per-connection state)."""
    retrying = Retrying(Backoff(policy.backoff_s, policy.max_backoff_s), policy.timeout_s)
    while True:
        try:
            return await attempt()
        except TRANSIENT_ERRORS as exc:
            delay = retrying.failed()  # the last try falls on the deadline
            if retrying.expired:
                log.error("redis unreachable, giving up", call=what, error=str(exc))
                raise
            log.warning(
                "redis unreachable, retrying",
                call=what,
                error=f"{type(exc).__name__}: {exc}",
                retry=retrying.failures,
                delay_s=round(delay, 2),
            )
            if on_error is not None:
                on_error()
            await trio.sleep(delay)


class RedisClient:
    """A pooled synchronous client, used from trio through worker threads.

    ``sync`` is a :class:`redis.Redis`, or for a cluster URL a :class:`RedisCluster` (typed
    as ``redis.Redis``: it offers the same commands for keys of one slot, which is all the
    queue layer uses).
    """

    def __init__(
        self,
        url: RedisURL | str,
        *,
        max_connections: int = 64,
        reconnect: Reconnect | None = None,
    ) -> None:
        self.url = url if isinstance(url, RedisURL) else RedisURL(url)
        self.reconnect = reconnect or Reconnect()
        self.cluster: RedisCluster | None = None
        self._pool: redis.ConnectionPool | None = None
        if self.url.cluster:
            (host, port), *others = self.url.seeds
            self.cluster = _ClusterClient(
                url=self.url.node_url(host, port).url,
                startup_nodes=[ClusterNode(h, p) for h, p in others],
                max_connections=max_connections,
                health_check_interval=30,
            )
            self.sync = cast(redis.Redis, self.cluster)
        else:
            self._pool = redis.ConnectionPool.from_url(
                self.url.url, max_connections=max_connections, health_check_interval=30
            )
            self.sync = redis.Redis(connection_pool=self._pool)
        self._limiter = trio.CapacityLimiter(max_connections)

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` (a blocking redis-py call) in a worker thread; ride out
        transient connection errors (see the module docstring): ``fn`` must be repeatable."""
        work = functools.partial(fn, *args, **kwargs)

        async def attempt() -> T:
            return await trio.to_thread.run_sync(work, limiter=self._limiter)

        return await with_reconnect(attempt, self.reconnect, _name(fn))

    async def execute(self, *args: Any) -> Any:
        return await self.call(self.sync.execute_command, *args)

    def node_url(self, key: str) -> RedisURL:
        """The URL of the server holding ``key``: the primary owning its slot on a cluster."""
        if self.cluster is None:
            return self.url
        node = self.cluster.get_node_from_key(key)
        return self.url.node_url(node.host, node.port)

    def blocking_connection(self, key: str | None = None) -> BlockingConnection:
        """A connection for blocking reads of ``key`` (required on a cluster: it picks the node)."""
        return BlockingConnection(self, key)

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.close()
        if self._pool is not None:
            self._pool.disconnect()


class BlockingConnection:
    """One dedicated connection for blocking commands, unblocked on cancellation.

    On a cluster it is a connection to the primary owning ``key``'s slot, and the unblocking
    goes to that node. If the slot has moved (resharding, a failover to a replica) the
    blocking call is answered ``MOVED``: the connection then moves to the new owner and the
    call is repeated once there.
    """

    def __init__(self, client: RedisClient, key: str | None = None) -> None:
        if client.cluster is not None and key is None:
            raise ValueError("on Redis Cluster a blocking connection needs the key it blocks on")
        self._client = client
        self._key = key
        self._id: int | None = None
        self._control: redis.Redis | None = None  # sends CLIENT UNBLOCK (cluster: same node)
        self.sync = self._connect(client.node_url(key) if key else client.url)

    def _connect(self, url: RedisURL) -> redis.Redis:
        if self._client.cluster is not None:
            self._control = redis.Redis.from_url(url.url, max_connections=2)
        # A pool of one connection rather than ``single_connection_client``, which connects in
        # the constructor: an actor that makes its reader while Redis restarts must not fail.
        # Calls here are sequential, so every command (CLIENT ID included) uses that one.
        return redis.Redis.from_url(url.url, max_connections=1)

    async def call(
        self,
        fn: Callable[..., T],
        *args: Any,
        interrupt: trio.Event | None = None,
        **kwargs: Any,
    ) -> T:
        """Run the blocking ``fn(*args, **kwargs)`` on this connection; cancellable.

        Setting ``interrupt`` (or having set it before) ends the blocking wait early without
        cancelling: the call returns what the command returns when unblocked (nothing new,
        or what it had already received), so nothing read is lost. Transient connection
        errors are retried like :meth:`RedisClient.call` (the connection, and with it its
        client id, is new afterwards).
        """

        def forget_id() -> None:
            self._id = None

        return await with_reconnect(
            functools.partial(self._call_moved, fn, *args, interrupt=interrupt, **kwargs),
            self._client.reconnect,
            _name(fn),
            on_error=forget_id,
        )

    async def _call_moved(
        self,
        fn: Callable[..., T],
        *args: Any,
        interrupt: trio.Event | None = None,
        **kwargs: Any,
    ) -> T:
        try:
            return await self._call(interrupt, fn, *args, **kwargs)
        except redis.exceptions.MovedError as moved:
            bound = getattr(fn, "__self__", None)
            if self._client.cluster is None or (bound is not self.sync and bound is not self):
                raise
            self.close()
            self._id = None
            self.sync = self._connect(self._client.url.node_url(moved.host, int(moved.port)))
            again = fn if bound is self else getattr(self.sync, fn.__name__)
            return await self._call(interrupt, again, *args, **kwargs)

    async def _call(
        self, interrupt: trio.Event | None, fn: Callable[..., T], *args: Any, **kwargs: Any
    ) -> T:
        if self._id is None:
            self._id = await trio.to_thread.run_sync(self.sync.client_id)
        done = False

        async def unblock_on_cancel() -> None:
            try:
                await (interrupt.wait() if interrupt is not None else trio.sleep_forever())
            finally:
                # The thread may not have reached the blocking call yet: repeat until it returns.
                with trio.CancelScope(shield=True):
                    while not done:
                        await self._unblock()
                        await trio.sleep(0.05)

        error: redis.RedisError | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(unblock_on_cancel)
            try:
                result = await trio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))
            except redis.RedisError as exc:  # raised as itself, not in an exception group
                error = exc
            finally:
                done = True
                nursery.cancel_scope.cancel()
        if error is not None:
            raise error
        return result

    async def execute(self, command: bytes, *, interrupt: trio.Event | None = None) -> Any:
        """:meth:`call` for a command encoded by :func:`encode_command`: its reply as parsed,
        without redis-py's packing and response callback."""
        return await self.call(self._execute, command, interrupt=interrupt)

    def _execute(self, command: bytes) -> Any:
        return execute_encoded(self.sync, command)  # self.sync: the node it moved to, if so

    async def _unblock(self) -> None:
        """One attempt, no reconnect wait (this runs shielded, while cancelling): with Redis
        unreachable the blocked call fails by itself."""
        control = self._control if self._control is not None else self._client.sync
        with contextlib.suppress(redis.RedisError):
            await trio.to_thread.run_sync(control.execute_command, "CLIENT", "UNBLOCK", self._id)

    def close(self) -> None:
        self.sync.close()
        if self._control is not None:
            self._control.close()


def _name(fn: Callable[..., Any]) -> str:
    """What a call is, for logs: the redis-py method or script name."""
    return str(getattr(fn, "__name__", None) or type(fn).__name__)
