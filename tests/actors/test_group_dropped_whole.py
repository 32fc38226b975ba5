"""A group whose sandbox stays unavailable (a real infrastructure failure: the Docker engine
its domain is configured for cannot be reached) is retried, released, redelivered up to
``queues.max_deliveries`` and then dropped whole: dead-lettered with its reason, nothing of
it executed or verified. Another group of the same run, on a healthy backend, goes through.
Real executor and verifier actors, real Redis, real process sandbox."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import trio
from structlog.testing import capture_logs

from streamrl.actors.executor import serve as executor_serve
from streamrl.actors.verifier import serve as verifier_serve
from streamrl.domains.registry import get_domain
from streamrl.protocol import names as N
from streamrl.protocol.messages import (
    Executed,
    Rollout,
    Sample,
    Sampling,
    Task,
    Trajectory,
    floats_to_bytes,
    ids_to_bytes,
    new_id,
    now,
)
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import DeadLetter, decode, encode
from streamrl.queues.streams import FIELD, Producer
from streamrl.testing.wait import wait_until
from tests.helpers import WatchedContext, more_calls, run_config


def _train_rollout(domain: str, text: str) -> Rollout:
    """A training group of two completions ``text`` of the domain's first train item."""
    item = get_domain(domain).load_items("train")[0]
    task = Task(
        id=new_id(), created_at=now(), policy_version=0, domain=domain, item_id=item.id,
        split="train", prompt=item.prompt, spec=msgspec.to_builtins(item),
        group_size=2, sampling=Sampling(),
    )  # fmt: skip
    sample = Sample(
        tokens=ids_to_bytes([5, 6]), logprobs=floats_to_bytes([-1.0, -1.0]), text=text,
        finish_reason="stop", weight_version=0,
    )  # fmt: skip
    return Rollout(id=new_id(), created_at=now(), policy_version=0, task=task,
                   prompt_ids=ids_to_bytes([1, 2, 3]), samples=[sample, sample])  # fmt: skip


async def _read(client: RedisClient, names: N.Names, stream: str, kind: type) -> list:
    rows = await client.call(client.sync.xrange, names.stream(stream))
    return [decode(f[FIELD], kind) for _, f in rows]


async def test_group_whose_sandbox_stays_unavailable_is_dropped_whole(
    client: RedisClient,
    names: N.Names,
    redis_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given `code` runs on a Docker engine that is not there, `arith` on the process backend
    import aiodocker  # noqa: F401  (imported here, not in the executor's first delivery)
    import trio_asyncio  # noqa: F401

    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-engine.sock")
    config = run_config(
        tmp_path, redis_url, names.run,
        "executor.backend=process",
        "executor.domains.code.backend=docker",
        "retry.max_retries=1",  # two tries in process per delivery, then released
        "retry.backoff_s=0.05",
        "retry.max_backoff_s=0.1",
        "queues.max_deliveries=2",
        # min idle well above what a first use blocks the loop for (imports): else a
        # delivery still in hand is reclaimed (its heartbeat starved) and counts as one more
        "queues.reclaim_min_idle_ms=3000",
        "queues.reclaim_interval_s=0.3",
        "queues.heartbeat_interval_s=0.3",
        "queues.block_ms=100",
    )
    ctx = WatchedContext(config, client, names)
    broken = _train_rollout("code", "```python\ndef f(*a):\n    return 0\n```")
    healthy = _train_rollout("arith", "```python\nprint(1)\n```")
    await Producer(client, names).publish_counted(  # both admitted (the admission record)
        N.ROLLOUTS, [encode(broken), encode(healthy)], names.admitted, 0,
        members=[broken.episode_id, healthy.episode_id],
    )
    dead_before = int(await client.call(client.sync.get, names.dead_groups) or 0)

    async def both_out() -> bool:  # a dead letter (the broken group) and a trajectory
        return bool(
            await _read(client, names, N.DEAD, DeadLetter)
            and await _read(client, names, N.TRAJECTORIES, Trajectory)
        )

    # When the executor and the verifier serve the run until the broken group is dead
    with capture_logs() as logs:
        async with trio.open_nursery() as nursery:
            await nursery.start(executor_serve, ctx)
            await nursery.start(verifier_serve, ctx)
            await wait_until(both_out, timeout=45, interval=0.1)
            await more_calls(ctx, N.ROLLOUTS, 3, "reclaim_calls")  # nothing comes back
            nursery.cancel_scope.cancel()

    # Then it was dead-lettered once, after max_deliveries (2) deliveries and one more,
    # with a reason that names the deliveries and the unavailable infrastructure
    [letter] = await _read(client, names, N.DEAD, DeadLetter)
    assert (letter.stream, letter.group, letter.deliveries) == (N.ROLLOUTS, "executor", 3)
    assert "delivered 3 times (> 2)" in letter.error, letter.error
    assert "infrastructure was unavailable" in letter.error, letter.error
    assert decode(letter.payload, Rollout).id == broken.id
    # ... and its admission slot freed with the letter (the scheduler admits a replacement)
    dead_after = int(await client.call(client.sync.get, names.dead_groups) or 0)
    assert dead_after == dead_before + 1
    # ... after each of its 2 deliveries was tried twice in process (the Docker engine
    # unreachable each time) and released for redelivery
    released = [e for e in logs if e["event"] == "handler unavailable, released"]
    assert len(released) == 2, released
    assert all("Docker engine unreachable" in e["error"] for e in released), released
    retried = [e for e in logs if e["event"] == "handler failed, retrying"]
    assert len(retried) == 2 and all("sandbox unavailable" in e["error"] for e in retried)
    assert sum(e["event"] == "reclaimed" for e in logs) == 2
    # Nothing of the broken group was executed or verified; the healthy one went through,
    # both its members run
    [executed] = await _read(client, names, N.EXECUTED, Executed)
    [trajectory] = await _read(client, names, N.TRAJECTORIES, Trajectory)
    assert executed.rollout.id == trajectory.rollout.id == healthy.id
    assert [o.stdout for o in executed.outcomes] == ["1\n", "1\n"]
    assert len(trajectory.rewards) == 2
    # and no entry is left pending in the executor's group
    pending = await client.call(client.sync.xpending, names.stream(N.ROLLOUTS), "executor")
    assert pending["pending"] == 0
