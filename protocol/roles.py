"""The roles of a run and what each may do in Redis: the ACL grants of its user.

Every process of the pipeline connects as the user of its role (:mod:`streamrl.queues.acl`
creates them); a role is allowed only the commands, on the keys, that its actor sends. The
table of roles is in docs/security.md.
"""

from __future__ import annotations

from collections.abc import Mapping

from streamrl.protocol import names as N
from streamrl.queues.acl import (
    CONSUME,
    FOLLOW,
    OBSERVE,
    REPAIR,
    SCRIPTS,
    TRIM,
    Credentials,
    Grant,
    apply_users,
    user_rules,
)
from streamrl.queues.acl import blob_pattern as _blobs
from streamrl.queues.acl import glob as _glob
from streamrl.queues.acl import stream_pattern as _stream
from streamrl.queues.client import RedisClient

ROLES = (
    "scheduler", "generator", "executor", "verifier", "learner", "monitor", "archiver", "admin"
)
"""The roles that get a user. ``monitor`` is what ``streamrl up`` does itself (progress,
evaluation rounds, the final evaluation); ``archiver`` keeps every trajectory on disk
(actors/archiver.py) through its own consumer groups; ``admin`` is the operator's, for
``streamrl status``, ``dlq``, ``replay`` and ``report`` on this run (runtime/auth.py
``ops_url``)."""

OPERATOR_ROLES = ("admin",)
"""Roles of a person, not of a process of the run: no actor runs as one, and ``streamrl acl
apply`` creates their user only where their password is set."""


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
    """The operator commands (cli/status.py, dlq.py, replay.py, report.py): observe every
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
    sends; ``leave_out``: commands the server does not know (``queues.acl.OPTIONAL``).
    """
    grants = run_grants(names, role, shards)
    return user_rules(password, grants, cluster=cluster, leave_out=leave_out)


def run_grants(names: N.Names, role: str, shards: int = 0) -> list[Grant]:
    """The grants of ``role`` on the unsharded layout of the run and on each of ``shards``."""
    layouts = [names, *(names.in_shard(k) for k in range(shards))]
    return list(dict.fromkeys(g for layout in layouts for g in role_grants(layout, role)))


async def apply_acls(
    client: RedisClient,
    names: N.Names,
    credentials: Mapping[str, Credentials],
    *,
    shards: int = 0,
) -> None:
    """Create or update the user of every role in ``credentials`` (role -> user, password),
    for a run whose work streams are also split in ``shards`` shards (see :func:`acl_rules`;
    :func:`streamrl.queues.acl.apply_users`)."""
    await apply_users(
        client, [(creds, run_grants(names, role, shards)) for role, creds in credentials.items()]
    )
