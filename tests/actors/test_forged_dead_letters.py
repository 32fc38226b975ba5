"""A dead letter's fields are claims: any stage role can write one to the dead-letter stream.
What ``streamrl dlq requeue`` gives back (an admission slot, the domain's failed and resolved
counts) is derived from the run's own records (the admission record, and what the letter's
script recorded when it released the group), never from the letter's ``group`` or
``counted`` fields, and no counter ever goes below zero. One test per forged field: the
counter key, the signed amount, a letter without ``counted``, a never-admitted group id.
Real Redis; the letters forged as the generator's ACL user, the real runtime dead-letters the
real one."""

from __future__ import annotations

import json
from pathlib import Path

from streamrl.actors.scheduler import Scheduler
from streamrl.cli.dlq import list_dead, requeue
from streamrl.config.schema import load_config
from streamrl.protocol import names as N
from streamrl.protocol.messages import Task
from streamrl.protocol.quarantine import counts
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import DeadLetter, decode, encode
from streamrl.queues.streams import ensure_group
from streamrl.runtime.context import ActorContext
from tests.actors.test_dead_groups import _dead_letter_all
from tests.chaos.badinputs import _task

COUNTS = [N.failed_counter("arith"), N.failed_counter("arith", "generator", "rejected"),
          N.resolved_counter("arith")]


async def _one_real_letter(
    client: RedisClient, names: N.Names, roles: dict[str, RedisClient], tmp_path: Path,
    redis_url: str,
) -> tuple[Scheduler, Task]:
    """One arith group admitted by the real scheduler and dead-lettered (rejected) by the real
    generator runtime: its slot freed, its failure and resolution counted, once."""
    config = load_config(None, [
        f"run.name={names.run}", f"run.redis_url={redis_url}", f"run.work_dir={tmp_path}",
        "scheduler.domains=['arith']", "scheduler.max_backlog=10",
        "learner.groups_per_step=1", "learner.max_staleness=0",
    ])
    scheduler = Scheduler(ActorContext(config, roles["scheduler"], names))
    await ensure_group(client, names.stream(N.TASKS), "generator")
    assert await scheduler.admit(1, 0, 0) == 1
    [(_, fields)] = await client.call(client.sync.xrange, names.stream(N.TASKS))
    task = decode(fields[b"d"], Task)
    await _dead_letter_all(client, roles["generator"], names, [], expect=1)
    assert await _state(client, names) == (1, [1, 1, 1], set())
    return scheduler, task


async def _forge(
    stage: RedisClient, names: N.Names, payload: bytes, **fields: object
) -> None:
    """A dead letter written straight to the dead-letter stream with a stage's credentials."""
    letter = DeadLetter(stream=N.TASKS, group="generator", entry_id="1-0", error="forged",
                        deliveries=1, payload=payload, at=0.0)
    entry = {"d": encode(letter), "error": "forged",
             **{k: v if isinstance(v, str) else json.dumps(v) for k, v in fields.items()}}
    await stage.call(stage.sync.xadd, names.stream(N.DEAD), entry)


async def _state(client: RedisClient, names: N.Names) -> tuple[int, list[int], set[str]]:
    """(dead_groups, the arith counts of COUNTS, the admission record)."""
    dead = int(await client.call(client.sync.get, names.dead_groups) or 0)
    record = await client.call(client.sync.smembers, names.admitted_groups)
    return dead, await counts(client, names, COUNTS), {m.decode() for m in record}


async def _requeue_forged(client: RedisClient, names: N.Names) -> None:
    forged = [e for e in await list_dead(client, names) if e.error == "forged"]
    assert len(forged) == 1
    await requeue(client, names, forged)


async def test_a_forged_counter_key_takes_nothing_back(
    client: RedisClient, names: N.Names, roles: dict[str, RedisClient], redis_url: str,
    tmp_path: Path,
) -> None:
    # Given a run with one real dead group, and a forged letter that claims it added -40 to
    # the run's dead_groups (a key no letter ever counts)
    scheduler, _ = await _one_real_letter(client, names, roles, tmp_path, redis_url)
    await _forge(roles["generator"], names, encode(_task()), group="",
                 counted=[[names.dead_groups, -40]])

    # When the operator requeues the forged letter
    await _requeue_forged(client, names)

    # Then nothing was given back: the scheduler still admits one replacement, not 41
    assert await _state(client, names) == (1, [1, 1, 1], set())
    assert (await scheduler.admissible(0))[0] == 1


async def test_a_forged_signed_amount_takes_nothing_back(
    client: RedisClient, names: N.Names, roles: dict[str, RedisClient], redis_url: str,
    tmp_path: Path,
) -> None:
    # Given a run with one real dead group, and a forged letter that claims it added -40 to
    # arith's failed groups (taking it back would add 40: the domain quarantined)
    await _one_real_letter(client, names, roles, tmp_path, redis_url)
    await _forge(roles["generator"], names, encode(_task()), group="",
                 counted=[[names.counter(N.failed_counter("arith")), -40]])

    # When the operator requeues it
    await _requeue_forged(client, names)

    # Then the counts are those of the one real letter
    assert await _state(client, names) == (1, [1, 1, 1], set())


async def test_a_letter_without_counted_gives_back_only_what_the_run_recorded(
    client: RedisClient, names: N.Names, roles: dict[str, RedisClient], redis_url: str,
    tmp_path: Path,
) -> None:
    # Given a real dead group, and a forged copy of its letter without the field "counted"
    scheduler, task = await _one_real_letter(client, names, roles, tmp_path, redis_url)
    await _forge(roles["generator"], names, encode(task), group=task.episode_id)

    # When the operator requeues every letter, the forged one first
    await _requeue_forged(client, names)
    await requeue(client, names, await list_dead(client, names))

    # Then the group's release was taken back once, with what the real letter counted, and
    # no counter went below zero
    assert await _state(client, names) == (0, [0, 0, 0], {task.episode_id})
    assert (await scheduler.admissible(0))[0] == 0


async def test_a_never_admitted_group_id_is_not_put_into_the_admission_record(
    client: RedisClient, names: N.Names, roles: dict[str, RedisClient], redis_url: str,
    tmp_path: Path,
) -> None:
    # Given a real dead group, and a forged letter of a training task the scheduler never
    # admitted, naming that task's group
    scheduler, _ = await _one_real_letter(client, names, roles, tmp_path, redis_url)
    never = _task()
    await _forge(roles["generator"], names, encode(never), group=never.episode_id,
                 counted=[[names.counter(c), 1] for c in COUNTS])

    # When the operator requeues it
    await _requeue_forged(client, names)

    # Then the never-admitted id is not in the admission record and the real release stands
    assert await _state(client, names) == (1, [1, 1, 1], set())
    assert (await scheduler.admissible(0))[0] == 1
