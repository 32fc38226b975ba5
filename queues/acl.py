"""Redis ACL users: one per actor role of a run, each allowed only what that role sends.

:func:`acl_rules` gives the ``ACL SETUSER`` rules of a role in a run; :func:`apply_acls`
creates or updates the users (idempotent: the rules start from ``reset``); :func:`role_url`
is the Redis URL a process of that role connects with. Guarantees, on Redis 7.0+ (ACL
selectors and read/write key permissions; Valkey too):

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
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import quote

import redis

from streamrl.queues import names as N
from streamrl.queues.client import RedisClient, RedisURL

ROLES = (
    "scheduler", "generator", "executor", "verifier", "learner", "monitor", "archiver", "admin"
)
"""The roles that get a user. ``monitor`` is what ``streamrl up`` does itself (progress,
evaluation rounds, the final evaluation); ``archiver`` keeps every trajectory on disk
(actors/archiver.py) through its own consumer groups; ``admin`` is the operator's, for
``streamrl status``, ``dlq``, ``replay`` and ``report`` on this run (actors/auth.py
``ops_url``)."""

OPERATOR_ROLES = ("admin",)
"""Roles of a person, not of a process of the run: no actor runs as one, and ``streamrl acl
apply`` creates their user only where their password is set."""

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


def _glob(key: str) -> str:
    """``key`` as an ACL pattern matching only itself (run names may hold glob characters)."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", key)


def _stream(names: N.Names, stream: str) -> str:
    return _glob(names.stream(stream))


def _blobs(names: N.Names, stream: str) -> str:
    """The claim-check blobs of ``stream`` (``<stream key>:blob:<id>``, queues/payloads.py)."""
    return _glob(names.stream(stream) + ":blob:") + "*"


def _consume(
    names: N.Names,
    stream: str,
    stage: str,
    outputs: tuple[str, ...] = (),
    counters: tuple[str, ...] = (),
) -> list[Grant]:
    """Consume ``stream`` in its group, trim it, and hand its entries off into ``outputs``
    (handoff scripts: dedup key, XADD, XACK) or to the dead-letter stream; observe the
    backlog of the work streams it feeds (producer-side backpressure)."""
    source, blobs = _stream(names, stream), _blobs(names, stream)
    dead, dead_groups = _stream(names, N.DEAD), _glob(names.dead_groups)
    admitted_groups = _glob(names.admitted_groups)
    outs = tuple(_stream(names, s) for s in outputs)
    out_blobs = tuple(_blobs(names, s) for s in outputs)
    dedup = (_glob(names.dedup(stage, "")) + "*",) if outputs else ()
    grants = [
        Grant(CONSUME + TRIM + REPAIR, rw=(source,)),
        Grant(("get", "del"), rw=(blobs,)),  # claim checks: fetched, deleted by the trim
        Grant(
            SCRIPTS,
            rw=(source, blobs, dead, dead_groups, admitted_groups, *outs, *dedup, *out_blobs,
                *counters),
        ),
        Grant(("xadd",), write=(dead, *outs)),
        Grant(("incr",), rw=(dead_groups,)),  # deadletter.lua: a training group's slot freed
        # ... if the group is in the admission record (once); the learner's hand-off takes
        # the groups it trained or dropped out of it
        Grant(("srem",), rw=(admitted_groups,)),
    ]
    if outputs:
        grants.append(Grant(("set",), write=(*dedup, *out_blobs)))
    if counters:  # the hand-off scripts add the counters they cause (Handoff.counters)
        grants.append(Grant(("incrby",), rw=counters))
    fed = tuple(_stream(names, s) for s in outputs if s in N.WORK_STREAMS)
    if fed:  # backpressure: the backlog of the groups it feeds; say it is paused on it
        grants.append(Grant(OBSERVE, read=fed))
        grants.append(Grant(("set",), write=(_glob(names.paused(stage)),)))
    return grants


def _produce(names: N.Names, *streams: str) -> list[Grant]:
    """queues.streams.Producer.publish: XADD, claim-check blobs first."""
    return [
        Grant(("xadd",), write=tuple(_stream(names, s) for s in streams)),
        Grant(("set",), write=tuple(_blobs(names, s) for s in streams)),
    ]


def _follow(names: N.Names, *streams: str) -> list[Grant]:
    return [Grant(FOLLOW, read=tuple(_stream(names, s) for s in streams))]


def role_grants(names: N.Names, role: str) -> list[Grant]:
    """Everything a process of ``role`` in run ``names`` may do, beyond :data:`CONNECTION`."""
    n = names
    tasks = _stream(n, N.TASKS)
    if role == "scheduler":
        admitted = _glob(n.admitted)
        admissions = _glob(n.admissions)
        admit_dedup = _glob(n.dedup("admit", "")) + "*"
        admitted_groups = _glob(n.admitted_groups)  # the admission record, per shard
        return [
            *_follow(n, N.WEIGHTS),  # the policy version
            Grant(OBSERVE, read=(tasks,)),  # the generator group's backlog
            *_produce(n, N.TASKS),  # evaluation rounds
            # publish_counted.lua: admission, the admitted groups recorded with it
            Grant(SCRIPTS, rw=(tasks, admitted, admitted_groups)),
            Grant(("sadd",), write=(admitted_groups,)),
            Grant(("get", "incrby"), rw=(admitted,)),
            # sharded runs (queues.shards): reserve_counted.lua in the run's slot, then
            # publish_once.lua into each shard, then the record is deleted
            Grant(SCRIPTS, rw=(admitted, admissions)),
            Grant(("hget", "hset", "hgetall", "hdel"), rw=(admissions,)),
            Grant(SCRIPTS, rw=(tasks, admit_dedup, _blobs(n, N.TASKS), admitted_groups)),
            Grant(("set",), write=(admit_dedup,)),
            Grant(("get", "incrby"), rw=(_glob(n.eval_round),)),
            Grant(("exists",), read=(_glob(n.stop),)),
            Grant(("get",), read=(_glob(n.counter("dropped_stale")),)),  # replaces drops
            Grant(("get",), read=(_glob(n.dead_groups),)),  # ... and dead-lettered groups
            # per-domain shares (actors/scheduling.py) and skipped zero-variance groups
            Grant(
                ("get", "mget"),
                read=(
                    _glob(n.counter("zero_variance")),
                    _glob(n.counter("resolved:")) + "*",
                    _glob(n.counter("trained:")) + "*",
                ),
            ),
        ]
    if role == "generator":
        return [*_consume(n, N.TASKS, role, (N.ROLLOUTS,)), *_follow(n, N.WEIGHTS)]
    if role == "executor":
        # multi-turn episodes: the next turn goes back to tasks (actors/episodes.py)
        return _consume(n, N.ROLLOUTS, role, (N.EXECUTED, N.TASKS))
    if role == "verifier":
        # zero_variance, resolved:<domain>, trained:<domain> (dynamic sampling, shares),
        # added by its hand-offs
        shares = (
            _glob(n.counter("zero_variance")),
            _glob(n.counter("resolved:")) + "*",
            _glob(n.counter("trained:")) + "*",
        )
        return _consume(n, N.EXECUTED, role, (N.TRAJECTORIES, N.EVALS), shares)
    if role == "learner":
        return [
            # dropped_stale, duplicates_skipped: added by the hand-off that settles the group
            *_consume(
                n, N.TRAJECTORIES, role, (N.WEIGHTS, N.METRICS),
                (_glob(n.counter("dropped_stale")), _glob(n.counter("duplicates_skipped"))),
            ),
            # the last, part-filled step of a run with max_train_groups (actors/learner.py):
            # admission closed and nothing left upstream
            Grant(("get",), read=(_glob(n.admitted),)),
            Grant(("hlen",), read=(_glob(n.admissions),)),
            Grant(
                OBSERVE,
                read=tuple(
                    _stream(n, s) for s in (N.TASKS, N.ROLLOUTS, N.EXECUTED, N.TRAJECTORIES)
                ),
            ),
            Grant(("xtrim",), write=(_stream(n, N.WEIGHTS), _stream(n, N.METRICS))),
        ]
    if role == "monitor":
        observed = tuple(_stream(n, s) for s in (*N.WORK_STREAMS, N.DEAD, N.METRICS))
        return [
            *_consume(n, N.EVALS, role),  # record held-out results, acknowledge
            *_follow(n, N.METRICS, N.WEIGHTS),
            Grant(OBSERVE, read=observed),
            Grant(("get", "mget"), read=(_glob(n.paused("")) + "*",)),  # stall: who is paused
            # the final evaluation of `streamrl up`: stop admission, publish one more round
            Grant(("set",), write=(_glob(n.stop),)),
            Grant(("get", "incrby"), rw=(_glob(n.eval_round),)),
            *_produce(n, N.TASKS),
        ]
    if role == "archiver":
        observed = tuple(_stream(n, s) for s in (*N.WORK_STREAMS, N.DEAD))
        return [
            # its own group on both; acknowledges after the Parquet file is durable
            *_consume(n, N.TRAJECTORIES, role),
            *_consume(n, N.EVALS, role),
            *_follow(n, N.METRICS),  # learner staleness and busy fraction, for /metrics
            Grant(OBSERVE, read=observed),  # every stream's lag, for /metrics
        ]
    if role == "admin":
        return _admin(n)
    raise ValueError(f"unknown role {role!r}: one of {', '.join(ROLES)}")


def _admin(n: N.Names) -> list[Grant]:
    """The operator commands (actors/status.py, dlq.py, replay.py, report.py): observe every
    queue, read the dead letters, the trajectories, the policy version and the learner's
    metrics, the claim-check blobs of every work stream; requeue a dead letter (requeue.lua:
    XRANGE and XDEL of the letter, XADD of its payload, claim-check blob first) and purge one
    (XDEL). No consumer group, no counter, no flag, no deletion of anything but dead letters."""
    work = tuple(_stream(n, s) for s in N.WORK_STREAMS)
    dead, dead_groups = _stream(n, N.DEAD), _glob(n.dead_groups)
    admitted_groups = _glob(n.admitted_groups)
    return [
        # status: length, lag, pending entries and consumers of every group; dead letters
        Grant((*OBSERVE, "xpending", "xinfo|consumers"), read=(*work, dead)),
        # status, stalls: when the learner last stepped, which stages are paused
        Grant(OBSERVE, read=(_stream(n, N.METRICS),)),
        Grant(("get", "mget"), read=(_glob(n.paused("")) + "*",)),
        # status, report, replay retrain: the policy version, the learner's step metrics
        Grant(("xrange", "xrevrange"), read=tuple(_stream(n, s) for s in N.RUN_GLOBAL_STREAMS)),
        # replay, report: trajectories stored behind a claim check; dlq show --out: the
        # blob a dead letter's claim-check reference names
        Grant(("get",), read=tuple(_blobs(n, s) for s in N.WORK_STREAMS)),
        # dlq requeue (a training group's letter takes its admission slot back), purge
        # (and goes back into the admission record)
        Grant(SCRIPTS, rw=(dead, dead_groups, admitted_groups, *work)),
        Grant(("decr",), rw=(dead_groups,)),
        Grant(("sadd",), write=(admitted_groups,)),
        Grant(("xdel",), write=(dead,)),
        Grant(("xadd",), write=work),
        Grant(("set",), write=tuple(_blobs(n, s) for s in N.WORK_STREAMS)),
    ]


def acl_rules(
    names: N.Names,
    role: str,
    password: str,
    *,
    shards: int = 0,
    cluster: bool = False,
    leave_out: frozenset[str] = frozenset(),
) -> list[str]:
    """The ``ACL SETUSER`` rules of ``role`` in run ``names`` (after the user name).

    ``shards``: the run's work streams are also split into this many shards (queues.shards),
    each granted like the unsharded layout; ``cluster``: also what redis-py's cluster client
    sends; ``leave_out``: commands of :data:`OPTIONAL` the server does not know.
    """
    digest = hashlib.sha256(password.encode()).hexdigest()
    connection = [f"+{c}" for c in CONNECTION + (CLUSTER if cluster else ()) if c not in leave_out]
    layouts = [names, *(names.in_shard(k) for k in range(shards))]
    grants = dict.fromkeys(g for layout in layouts for g in role_grants(layout, role))
    selectors = [g.selector(leave_out) for g in grants]
    reset = ["reset", "on", f"#{digest}", "resetkeys", "resetchannels", "-@all"]
    return [*reset, *connection, *selectors]


def _setuser(
    sync: redis.Redis, names: N.Names, role: str, creds: Credentials, shards: int, cluster: bool
) -> None:
    leave_out: frozenset[str] = frozenset()
    while True:
        rules = acl_rules(
            names, role, creds.password, shards=shards, cluster=cluster, leave_out=leave_out
        )
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


async def apply_acls(
    client: RedisClient,
    names: N.Names,
    credentials: Mapping[str, Credentials],
    *,
    shards: int = 0,
) -> None:
    """Create or update the user of every role in ``credentials`` (role -> user, password),
    for a run whose work streams are also split in ``shards`` shards (see :func:`acl_rules`).

    ``client`` connects as an admin (a user allowed ``ACL SETUSER``; on a cluster the users
    are set on every node). A user whose rules or password changed is updated in place: its
    open connections stay authenticated and get the new rules at once.

    Where the server has an ACL file (``aclfile``: the embedded server and the shipped Redis
    configuration), the users are saved to it, so a Redis restart keeps them; without one they
    live in memory only and must be applied again after a restart.
    """
    cluster = client.url.cluster
    for role, creds in credentials.items():
        await client.call(_setuser, client.sync, names, role, creds, shards, cluster)
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
