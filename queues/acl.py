"""Redis ACL users: one per user of a run, each granted only the commands it sends, on the
keys it sends them to. The broker knows no roles: the pipeline protocol
(:mod:`streamrl.protocol.roles`) derives each role's grants from its table of the operations
that role performs (``ROLE_OPS``; ``acl_rules`` and ``apply_acls`` there) and hands them here.

:func:`user_rules` gives the ``ACL SETUSER`` rules of a list of :class:`Grant`;
:func:`apply_users` creates or updates the users (idempotent: the rules start from
``reset``); :func:`missing_users` tells which a restarted Redis lost; :func:`role_url` is the
Redis URL a process of a user connects with. Guarantees, on Redis 7.0+ (ACL selectors and
read/write key permissions; Valkey too):

- every permission is a grant of some commands on some keys (one ACL selector each), so a
  command is allowed only on the keys it is granted for: a generator may XADD to
  ``rollouts`` but not read it, may consume ``tasks`` but not add to it, and can reach no key
  of the learner's (``trajectories``, ``weights`` writes, its counter);
- a role reaches only keys of its own run (``streamrl:{<run>}:``): runs that share one Redis
  cannot touch each other;
- no role may run an administrative or keyspace-wide command (FLUSHALL, CONFIG, KEYS, SCAN,
  ACL, DEBUG, SHUTDOWN, ...) or use a pub/sub channel;
- a password is sent as its SHA-256 (``#<hex>``), never in clear.

Scripts: Redis checks EVALSHA against read and write access to all of its KEYS, then checks
every command the script runs against the grants again, so a script can do no more than its
caller could do directly.

Not covered (ACL rules do not see arguments): a role that may XADD to a stream may also trim
it (``XADD ... MAXLEN``); a consumer may acknowledge entries of its group it never handled;
``CLIENT UNBLOCK`` accepts any client id; a consumer may move its input stream's group
cursors with ``XGROUP SETID`` (granted for repair_lag.lua, which sets only ``ENTRIESREAD`` at the
group's own id; reading and acknowledging could skip entries anyway); the ``admin`` role,
which requeues dead letters, may add any entry to the run's work streams.

Two users are not alike: the ``admin`` *role* is the operator's user of one run, for the
operator commands (``streamrl status``, ``dlq``, ``replay``, ``report``); creating users
(``streamrl acl apply``, ``streamrl up``) needs ``ACL SETUSER``, which no role has: that is
the Redis URL's own user (in effect a superuser), for which no user is created. The table of
roles is in docs/security.md.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from urllib.parse import quote

import redis

from streamrl.queues.client import RedisClient, RedisURL
from streamrl.queues.keys import Layout

CONNECTION = (
    "ping",
    "select",
    "client|id",
    "client|unblock",
    "client|setinfo",
    "script|load",
    "script|exists",
)
"""Key-less commands every role sends: health checks, SELECT of the URL's database, the
blocking connection's id and its unblock (queues.client), redis-py's library info, and the
loading of the Lua scripts (redis-py's Script: EVALSHA, SCRIPT LOAD when missing)."""

OPTIONAL = ("client|setinfo",)
"""Granted where the server knows them (Redis 7.2+); redis-py ignores their refusal."""

CLUSTER = ("cluster|slots", "command", "asking")
"""Key-less commands of redis-py's cluster client: the slot map, the command table (to find a
command's keys), and following an ASK redirection during resharding."""

CONSUME = ("xreadgroup", "xack", "xpending", "xautoclaim", "xclaim", "xgroup|create")
"""queues.streams.StreamConsumer on its input stream: read (own pending, new), delivery
counts, reclaim, heartbeat, acknowledge, create the group."""
TRIM = (
    "exists",
    "xinfo|groups",
    "xinfo|consumers",
    "xrange",
    "xrevrange",
    "xtrim",
    "xgroup|delconsumer",
)
"""queues/trim.lua, run by the consumers of a stream (with XPENDING, and DEL of the blobs):
delete acknowledged entries, forget idle consumers that hold nothing."""
SCRIPTS = ("evalsha", "eval")
"""The Lua scripts (EVAL: scripts in a cluster pipeline are sent with their text)."""
FOLLOW = ("xread", "xrevrange")
"""queues.streams.EventReader: the latest event, then every new one."""
OBSERVE = (
    "exists", "xlen", "xinfo|groups", "xinfo|stream", "xrange", "time", "evalsha_ro", "eval_ro"
)
"""queues.stats: length, lag and pending of a group, when the newest entry was added, on the
server's clock (backlog.lua, a read-only script: XRANGE checks the reported lag and counts it
where the server's figure is impossible)."""
REPAIR = ("xinfo|stream", "xgroup|setid")
"""queues/repair_lag.lua, run by the consumers of a stream: set their group's entries-read
right again (at the group's own last-delivered id) where the server lost it."""


@dataclass(frozen=True)
class Grant:
    """``commands`` allowed on these key patterns (ACL globs), as one ACL selector."""

    commands: tuple[str, ...]
    rw: tuple[str, ...] = ()
    read: tuple[str, ...] = ()
    write: tuple[str, ...] = ()

    def selector(self, leave_out: frozenset[str] = frozenset()) -> str:
        keys = [f"~{p}" for p in self.rw]
        keys += [f"%R~{p}" for p in self.read]
        keys += [f"%W~{p}" for p in self.write]
        commands = [f"+{c}" for c in self.commands if c not in leave_out]
        return "(" + " ".join(["resetchannels", *keys, *commands]) + ")"


@dataclass(frozen=True)
class Credentials:
    user: str
    password: str = field(repr=False)


def glob(key: str) -> str:
    """``key`` as an ACL pattern matching only itself (run names may hold glob characters)."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", key)


def stream_pattern(layout: Layout, stream: str) -> str:
    """The key of ``stream`` in ``layout`` as an ACL pattern."""
    return glob(layout.stream(stream))


def blob_pattern(layout: Layout, stream: str) -> str:
    """The claim-check blobs of ``stream`` (``<stream key>:blob:<id>``, queues/payloads.py)."""
    return glob(layout.stream(stream) + ":blob:") + "*"


def user_rules(
    password: str,
    grants: Iterable[Grant],
    *,
    cluster: bool = False,
    leave_out: frozenset[str] = frozenset(),
) -> list[str]:
    """The ``ACL SETUSER`` rules (after the user name) of a user with ``password`` allowed
    :data:`CONNECTION` and ``grants`` (one selector each, duplicates once); ``cluster``: also
    what redis-py's cluster client sends; ``leave_out``: commands of :data:`OPTIONAL` the
    server does not know."""
    digest = hashlib.sha256(password.encode()).hexdigest()
    connection = [f"+{c}" for c in CONNECTION + (CLUSTER if cluster else ()) if c not in leave_out]
    selectors = [g.selector(leave_out) for g in dict.fromkeys(grants)]
    reset = ["reset", "on", f"#{digest}", "resetkeys", "resetchannels", "-@all"]
    return [*reset, *connection, *selectors]


def _setuser(sync: redis.Redis, creds: Credentials, grants: list[Grant], cluster: bool) -> None:
    leave_out: frozenset[str] = frozenset()
    while True:
        rules = user_rules(creds.password, grants, cluster=cluster, leave_out=leave_out)
        try:
            # ACL users are per node: on a cluster, set them on every node
            on_all = {"target_nodes": "all"} if cluster else {}
            sync.execute_command("ACL", "SETUSER", creds.user, *rules, **on_all)
            return
        except redis.ResponseError as exc:
            unknown = {c for c in OPTIONAL if f"+{c}'" in str(exc)} - leave_out
            if not unknown:
                raise RuntimeError(
                    f"cannot create the ACL user {creds.user!r} (needs Redis 7.0+ and an admin "
                    f"user allowed ACL SETUSER; or set auth.enabled = false): {exc}"
                ) from None
            leave_out |= unknown


async def apply_users(
    client: RedisClient, users: Iterable[tuple[Credentials, list[Grant]]]
) -> None:
    """Create or update each user (credentials, grants).

    ``client`` connects as an admin (a user allowed ``ACL SETUSER``; on a cluster the users
    are set on every node). A user whose rules or password changed is updated in place: its
    open connections stay authenticated and get the new rules at once.

    Where the server has an ACL file (``aclfile``: the embedded server and the shipped Redis
    configuration), the users are saved to it, so a Redis restart keeps them; without one they
    live in memory only and must be applied again after a restart.
    """
    cluster = client.url.cluster
    for creds, grants in users:
        await client.call(_setuser, client.sync, creds, grants, cluster)
    await client.call(_save_if_aclfile, client.sync, cluster)


async def missing_users(client: RedisClient, users: list[str]) -> list[str]:
    """Those of ``users`` the server does not know (on a cluster: some node does not); one
    ``ACL USERS`` per node. ``client`` connects as an admin (``ACL`` allowed)."""

    def missing() -> list[str]:
        cluster = client.url.cluster
        reply = client.sync.execute_command(
            "ACL", "USERS", **({"target_nodes": "all"} if cluster else {})
        )
        per_node = list(reply.values()) if isinstance(reply, dict) else [reply]
        known = [{u.decode() if isinstance(u, bytes) else u for u in node} for node in per_node]
        return [u for u in users if not all(u in node for node in known)]

    return await client.call(missing)


def _save_if_aclfile(sync: redis.Redis, cluster: bool) -> bool:
    """``ACL SAVE`` on every node that has an ``aclfile``; True when at least one did."""
    on_all = {"target_nodes": "all"} if cluster else {}
    try:
        found = sync.config_get("aclfile", **on_all)
    except redis.ResponseError:  # CONFIG not allowed for this admin: cannot tell, do not save
        return False
    replies = found.values() if cluster else [found]
    if not any(isinstance(r, dict) and r.get("aclfile") for r in replies):
        return False
    sync.execute_command("ACL", "SAVE", **on_all)
    return True


def role_url(base_url: str, credentials: Credentials) -> str:
    """``base_url`` with ``credentials`` instead of its own (URL-quoted)."""
    user, password = quote(credentials.user, safe=""), quote(credentials.password, safe="")
    return RedisURL(base_url).with_credentials(user, password).url
