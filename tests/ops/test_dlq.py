"""Dead letters: a poison message is dead-lettered, the config is fixed, the letter is
requeued and runs through the normal path to completion; purge asks first."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import trio

import streamrl.domains.arith.domain  # noqa: F401  (registers the arith domain)
from streamrl.actors.verifier import serve
from streamrl.cli.dlq import Selection, list_dead, requeue, run_dlq
from streamrl.protocol import names as N
from streamrl.protocol.messages import Trajectory
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import decode, encode
from streamrl.queues.streams import Producer
from streamrl.runtime.context import ActorContext
from streamrl.testing.wait import wait_until
from tests.ops.helpers import config, executed


async def _serve_until(ctx: ActorContext, done: Callable[[], Awaitable[object]]) -> None:
    """Run the real verifier actor until ``done()`` (an async predicate) holds."""
    async with trio.open_nursery() as nursery:
        await nursery.start(serve, ctx)
        await wait_until(done, timeout=20)
        nursery.cancel_scope.cancel()


async def test_poison_message_fixed_by_config_is_requeued_and_completes(
    client: RedisClient, names: N.Names, redis_url: str, tmp_path: Path
) -> None:
    # Given an executed group with 3 kB of stderr and a verifier allowed only 2 kB messages
    poison = executed("42", ["42", "41"], stderr="x" * 3000)
    await Producer(client, names).publish(N.EXECUTED, [encode(poison)])
    small = config(tmp_path, redis_url, names.run,
                   "queues.max_message_bytes=2000", "queues.claim_check_bytes=1000")

    # When the verifier reads it, it is dead-lettered with the reason
    async def dead() -> bool:
        return bool(await list_dead(client, names))

    await _serve_until(ActorContext(small, client, names), dead)
    [letter] = await list_dead(client, names)
    assert letter.letter is not None and letter.letter.stream == N.EXECUTED
    assert "over the limit" in letter.error
    assert await client.call(client.sync.xlen, names.stream(N.TRAJECTORIES)) == 0

    # When the limit is raised (the fix) and the letter requeued through the CLI body
    assert await run_dlq(client, names, "requeue", Selection(stream=N.EXECUTED)) == 0
    assert await list_dead(client, names) == []
    fixed = config(tmp_path, redis_url, names.run)

    async def verified() -> bool:
        return bool(await client.call(client.sync.xlen, names.stream(N.TRAJECTORIES)))

    await _serve_until(ActorContext(fixed, client, names), verified)

    # Then it completed through the normal path: scored, no new dead letter
    [(_, fields)] = await client.call(client.sync.xrange, names.stream(N.TRAJECTORIES))
    trajectory = decode(fields[b"d"], Trajectory)
    assert trajectory.rollout.task.id == poison.rollout.task.id
    assert trajectory.rewards == [1.0, 0.0]
    assert await list_dead(client, names) == []


async def test_requeue_is_once_and_purge_needs_confirmation(
    client: RedisClient, names: N.Names, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given two dead letters from different streams
    dead_key = names.stream(N.DEAD)
    from streamrl.protocol.messages import now
    from streamrl.queues.codec import DeadLetter

    for stream, err in ((N.EXECUTED, "boom: bad sandbox"), (N.TASKS, "unknown domain")):
        letter = DeadLetter(stream=stream, group="g", entry_id="1-0", error=err, deliveries=3,
                            payload=encode(executed("1", ["1"])), at=now())
        await client.call(client.sync.xadd, dead_key, {"d": encode(letter), "error": err})
    entries = await list_dead(client, names, Selection(error="sandbox"))
    assert [e.letter.stream for e in entries if e.letter] == [N.EXECUTED]

    # show decodes the payload as its stream's message (byte fields by size)
    assert await run_dlq(client, names, "show", Selection(ids=(entries[0].dead_id,))) == 0
    [shown] = json.loads(capsys.readouterr().out)
    assert shown["error"] == "boom: bad sandbox" and shown["deliveries"] == 3
    assert shown["payload"]["type"] == "Executed"
    assert shown["payload"]["message"]["rollout"]["prompt_ids"] == "<12 bytes>"

    # When the same letter is requeued twice (two operators, or a repeated call)
    first = await requeue(client, names, entries)
    second = await requeue(client, names, entries)
    # Then it is added once
    assert first[0][1] is not None and second[0][1] is None
    assert await client.call(client.sync.xlen, names.stream(N.EXECUTED)) == 1

    # Purge asks; "n" keeps everything, --yes deletes
    assert await run_dlq(client, names, "purge", Selection(all=True),
                         confirm=lambda _: "n") == 1
    assert len(await list_dead(client, names)) == 1
    assert await run_dlq(client, names, "purge", Selection(all=True), yes=True) == 0
    assert await list_dead(client, names) == []
