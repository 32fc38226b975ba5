"""The roles of a run and what each does in Redis: one table of operations per role
(:data:`ROLE_OPS`), from which the ACL grants of its user are derived.

Every process of the pipeline connects as the user of its role (:mod:`streamrl.queues.acl`
creates them); a role is allowed only the commands, on the keys, of the operations its table
names (:mod:`streamrl.queues.operations`), so code that performs an operation its table lacks
is refused by Redis (``NOPERM``). The table is printed in docs/security.md
(:func:`role_table`, checked by tests/queues/test_role_ops.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from streamrl.protocol import names as N
from streamrl.queues.acl import (
    CONSUME,
    OBSERVE,
    REPAIR,
    SCRIPTS,
    TRIM,
    Credentials,
    Grant,
    apply_users,
    user_rules,
)
from streamrl.queues.acl import glob as _glob
from streamrl.queues.client import RedisClient
from streamrl.queues.operations import (
    Consume,
    CountPending,
    CountReservations,
    DeleteFields,
    Follow,
    Increment,
    Key,
    Observe,
    Op,
    Produce,
    PublishCounted,
    ReadBlobs,
    ReadCounters,
    ReadFlag,
    ReadHash,
    ReadPaused,
    ReadRange,
    ReadStored,
    ReadTally,
    RequeueDead,
    SetFields,
    SetFlag,
    TrimEvents,
    counter,
    grants_of,
)

ROLES = (
    "scheduler", "generator", "executor", "verifier", "learner", "monitor", "archiver", "admin",
    "autoscaler",
)
"""The roles that get a user. ``monitor`` is what ``streamrl up`` does itself (progress,
evaluation rounds, the final evaluation); ``archiver`` keeps every trajectory on disk
(actors/archiver.py) through its own consumer groups; ``admin`` is the operator's, for
``streamrl status``, ``dlq``, ``replay`` and ``report`` on this run (runtime/auth.py
``ops_url``); ``autoscaler`` is KEDA's (deploy/kubernetes/keda.yaml): the pending counts of
the scaled stages' groups, nothing else."""

OPERATOR_ROLES = ("admin", "autoscaler")
"""Roles of a person or of a service outside the run, not of a process of it: no actor runs
as one, and ``streamrl acl apply`` creates their user only where their password is set."""


FAILED = counter("failed:", prefix=True)
RESOLVED = counter("resolved:", prefix=True)


def consume(
    stream: str, outputs: tuple[str, ...] = (), counters: tuple[Key, ...] = ()
) -> Consume:
    """The role of ``stream``'s group consumes it, hands off into ``outputs`` (adding
    ``counters``) and observes the backlog of the work streams among them (backpressure).
    On the training path its dead letters add the domain's failure counters, and upstream of
    the verifier its resolved groups (runtime.serve.dead_letter)."""
    stage = N.GROUP_OF_STREAM[stream]
    watch = tuple(s for s in outputs if s in N.WORK_STREAMS)
    health: tuple[Key, ...] = (FAILED, RESOLVED) if stream in N.UNRESOLVED_STREAMS else ()
    health += (FAILED,) if stream == N.TRAJECTORIES else ()
    return Consume(stream, stage, outputs, tuple(dict.fromkeys((*counters, *health))), watch)


SHARES = (counter("zero_variance"), RESOLVED, counter("trained:", prefix=True))
"""The verifier's counters: zero-variance skips, per-domain resolved and trained groups."""

ADMITTED = Key(lambda n: n.admitted)
ADMITTED_BY_DOMAIN = Key(lambda n: n.admitted_by_domain)
EVAL_ROUND = Key(lambda n: n.eval_round)
STOP = Key(lambda n: n.stop)
DEAD_GROUPS = Key(lambda n: n.dead_groups)
QUARANTINE = Key(lambda n: n.quarantine)
FLEET = Key(lambda n: n.fleet)
HELD_BACK = Key(lambda n: n.held_back)
DOMAIN_HEALTH = (
    ReadTally(ADMITTED_BY_DOMAIN), ReadCounters((*SHARES, FAILED)), ReadHash(QUARANTINE)
)
"""The per-domain figures of the summary and ``streamrl status`` (protocol/health.py): the
admitted tally, the verifier's counters, the failed groups (by stage and cause) and the
quarantined domains."""
UPSTREAM = (N.TASKS, N.ROLLOUTS, N.EXECUTED, N.TRAJECTORIES)
CONTEXTS = (Key(lambda n: n.context(""), prefix=True),)
"""The stored contexts of multi-turn episodes (``ctx:<episode>``, per shard)."""

ROLE_OPS: dict[str, tuple[Op, ...]] = {
    "scheduler": (
        Follow((N.WEIGHTS,)),  # the policy version
        # the generator group's backlog, less the held-out round's tasks still queued
        Observe((N.TASKS,), detail=True),
        # admission (protocol/admission.py), counted per domain with it
        PublishCounted(N.TASKS, ADMITTED, tally=ADMITTED_BY_DOMAIN),
        Produce((N.TASKS,)),  # evaluation rounds
        Increment(EVAL_ROUND),
        ReadFlag(STOP),
        # the staleness bound's D (replaced drops, skips, dead groups), the domain shares
        # and their failed groups (quarantine)
        ReadCounters((counter("dropped_stale"), counter("no_signal"), DEAD_GROUPS, *SHARES,
                      FAILED)),
        # quarantine: a domain past its failure threshold, and the operator's lifts
        # (protocol/quarantine.py)
        ReadHash(QUARANTINE),
        SetFields(QUARANTINE),
        SetFields(HELD_BACK),  # a curriculum level not taken, and why (protocol/curriculum.py)
    ),
    # multi-turn episodes: a turn's context by reference (runtime/contexts.py): read here
    "generator": (consume(N.TASKS, (N.ROLLOUTS,)), Follow((N.WEIGHTS,)), ReadStored(CONTEXTS)),
    # multi-turn episodes: the next turn goes back to tasks (actors/episodes.py), its context
    # part stored by the hand-off, the episode's hash deleted by the one that ends it
    "executor": (
        dataclasses.replace(consume(N.ROLLOUTS, (N.EXECUTED, N.TASKS)), stores=CONTEXTS),
        ReadStored(CONTEXTS),
        SetFields(FLEET),  # its Docker backends' fleet counts, for status
    ),
    # the episode's whole context joined once for the trajectory, its hash deleted
    "verifier": (
        dataclasses.replace(consume(N.EXECUTED, (N.TRAJECTORIES, N.EVALS), SHARES),
                            stores=CONTEXTS),
        ReadStored(CONTEXTS),
    ),
    "learner": (
        # dropped_stale, duplicates_skipped, no_signal: added by the hand-off that settles
        # the group
        consume(
            N.TRAJECTORIES, (N.WEIGHTS, N.METRICS),
            (counter("dropped_stale"), counter("duplicates_skipped"), counter("no_signal")),
        ),
        # the last, part-filled step of a run with max_train_groups (protocol/admission.py):
        # admission closed and nothing left upstream
        ReadCounters((ADMITTED,)),
        CountReservations(),
        Observe(UPSTREAM),
        TrimEvents((N.WEIGHTS, N.METRICS)),
    ),
    "monitor": (
        consume(N.EVALS),  # record held-out results, acknowledge
        Follow((N.METRICS, N.WEIGHTS, N.DEAD)),  # dead: held-out items lost on their way
        Observe((*N.WORK_STREAMS, N.DEAD, N.METRICS)),
        ReadPaused(),  # stall: who is paused
        # the final evaluation of `streamrl up`: stop admission, publish one more round
        SetFlag(STOP),
        Increment(EVAL_ROUND),
        Produce((N.TASKS,)),
        *DOMAIN_HEALTH,  # the summary's per-domain figures, dead letters and quarantine
        ReadCounters((counter("no_signal"),)),  # the learner's batches without signal
    ),
    "archiver": (
        # its own group on both; acknowledges after the Parquet file is durable
        Consume(N.TRAJECTORIES, "archiver"),
        Consume(N.EVALS, "archiver"),
        Follow((N.METRICS,)),  # learner staleness and busy fraction, for /metrics
        Observe((*N.WORK_STREAMS, N.DEAD)),  # every stream's lag, for /metrics
    ),
    # The operator commands (cli/status.py, dlq.py, replay.py, report.py). No consumer group,
    # no counter, no flag, no deletion of anything but dead letters.
    "admin": (
        # status: length, lag, pending entries and consumers of every group; dead letters
        Observe((*N.WORK_STREAMS, N.DEAD), detail=True),
        # status, stalls: when the learner last stepped, which stages are paused
        Observe((N.METRICS,)),
        ReadPaused(),
        # status, report, replay retrain: the policy version, the learner's step metrics
        ReadRange(N.RUN_GLOBAL_STREAMS),
        # replay, report: trajectories behind a claim check; dlq show --out: a letter's blob
        ReadBlobs(N.WORK_STREAMS),
        # dlq requeue (a training group's letter takes its admission slot back, and its
        # domain's failed and resolved counts), purge
        RequeueDead(N.WORK_STREAMS, (FAILED, RESOLVED)),
        # status: the per-domain lines (failures, quarantined and why); domains list, lift
        *DOMAIN_HEALTH,
        DeleteFields(QUARANTINE),
        ReadHash(FLEET),  # status: the executors' sandbox fleets
        ReadHash(HELD_BACK),  # status: curriculum domains held below a level, and why
    ),
    # KEDA's ScaledObjects (deploy/kubernetes/keda.yaml): how many entries the generator,
    # executor and verifier groups hold pending, to size each stage; nothing else
    "autoscaler": (CountPending((N.TASKS, N.ROLLOUTS, N.EXECUTED)),),
}
"""What each role does in Redis: the one table its ACL grants are derived from."""


def role_ops(role: str) -> tuple[Op, ...]:
    if role not in ROLE_OPS:
        raise ValueError(f"unknown role {role!r}: one of {', '.join(ROLES)}")
    return ROLE_OPS[role]


def role_grants(names: N.Names, role: str) -> list[Grant]:
    """Everything a process of ``role`` in run ``names`` may do, beyond :data:`CONNECTION`:
    the grants of its operations (:data:`ROLE_OPS`) on this layout."""
    return grants_of(role_ops(role), [names])


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


def role_table(run: str = "<run>") -> str:
    """The Markdown table of docs/security.md: every role's operations (:data:`ROLE_OPS`) and
    the grants each derives on an unsharded run (a sharded one: the same in every shard)."""
    names = N.Names(run)
    rows = ["| role | operation | commands | keys |", "|---|---|---|---|"]
    for role in ROLES:
        shown = role
        for op in ROLE_OPS[role]:
            label = _label(names, op)
            for grant in op.grants(names):  # one ACL selector per row
                rows.append(f"| {shown} | {label} | {_commands(grant.commands)} | "
                            f"{_keys(names, grant)} |")
                shown = label = ""
    return "\n".join(rows) + "\n"


_GROUPS = {CONSUME + TRIM + REPAIR: "consume", SCRIPTS: "scripts", OBSERVE: "observe"}


def _commands(commands: tuple[str, ...]) -> str:
    for group, word in _GROUPS.items():
        if commands[: len(group)] == group:
            rest = " ".join(c.upper().replace("|", " ") for c in commands[len(group) :])
            return f"*{word}*" + (f" `{rest}`" if rest else "")
    return "`" + " ".join(c.upper().replace("|", " ") for c in commands) + "`"


def _short(names: N.Names, pattern: str) -> str:
    return pattern.removeprefix(_glob(names.prefix))


def _keys(names: N.Names, grant: Grant) -> str:
    parts = [f"RW `{_short(names, p)}`" for p in grant.rw]
    parts += [f"R `{_short(names, p)}`" for p in grant.read]
    parts += [f"W `{_short(names, p)}`" for p in grant.write]
    return ", ".join(parts)


def _label(names: N.Names, op: Op) -> str:
    args: list[str] = []
    for f in dataclasses.fields(op):  # type: ignore[arg-type]
        if f.name == "watch":  # the outputs it feeds, named already
            continue
        value = getattr(op, f.name)
        items = value if isinstance(value, tuple) else (value,)
        shown = [_short(names, v.pattern(names)) if isinstance(v, Key) else str(v)
                 for v in items if not isinstance(v, bool)]
        if isinstance(value, bool):
            shown = [f.name] if value else []
        if shown:
            args.append(" ".join(shown))
    return f"{type(op).__name__}({', '.join(args)})"
