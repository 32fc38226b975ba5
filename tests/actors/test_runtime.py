"""The actor runtime against a real Redis: retries with backoff, time limits, dead letters.

Time-based policies run under trio's autojump clock, so a 100 s backoff takes no real time.
"""

from __future__ import annotations

import dataclasses

import msgspec
import trio
import trio.testing

from streamrl.protocol import names as N
from streamrl.protocol.messages import Sampling, Task, new_id, now
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import DeadLetter, decode, encode
from streamrl.queues.payloads import PayloadLimits
from streamrl.queues.stats import paused_stages
from streamrl.queues.streams import ConsumerSettings, Producer, ensure_group, open_stream_consumer
from streamrl.runtime.policies import Policies, Reject, Retry, RetryPolicy, Unavailable
from streamrl.runtime.serve import ActorRuntime, Output, RuntimeSettings
from streamrl.testing.wait import wait_until


def _task(i: int = 0) -> Task:
    return Task(
        id=new_id(),
        created_at=now(),
        policy_version=0,
        domain="d",
        item_id=str(i),
        split="train",
        prompt="p",
        spec={},
        group_size=1,
        sampling=Sampling(),
    )


class Scripted:
    """An actor whose handle follows a script of outcomes per call."""

    stage = "scripted"
    input_stream = N.TASKS
    input_type = Task

    def __init__(self, script: list[str], hang_s: float = 0.0) -> None:
        self.script = script
        self.calls: list[float] = []
        self.hang_s = hang_s

    async def handle(self, task: Task) -> list[Output]:
        self.calls.append(trio.current_time())
        step = self.script[min(len(self.calls) - 1, len(self.script) - 1)]
        if step == "fail":
            raise RuntimeError("boom")
        if step == "retry":
            raise Retry("later", delay=100.0)
        if step == "unavailable":
            raise Unavailable("engine down", delay=0.01)
        if step == "reject":
            raise Reject("never valid")
        if step == "hang":
            await trio.sleep(self.hang_s)
        return [Output(N.ROLLOUTS, task)]


async def _run_until_settled(
    client: RedisClient, names: N.Names, actor: Scripted, policies: Policies, payloads: list[bytes]
) -> None:
    await Producer(client, names).publish(N.TASKS, payloads)
    settings = ConsumerSettings(block_ms=50)
    async with open_stream_consumer(client, names, N.TASKS, stage="s", settings=settings) as c:
        runtime = ActorRuntime(c, actor, policies, RuntimeSettings(concurrency=2))
        async with trio.open_nursery() as nursery:
            await nursery.start(runtime.serve)
            while True:
                info = await client.call(client.sync.xpending, c.stream, c.group)
                settled = runtime.statistics().handled + runtime.statistics().dead_lettered
                if info["pending"] == 0 and settled == len(payloads):
                    break
                await trio.sleep(0.5)
            nursery.cancel_scope.cancel()


async def _dead(client: RedisClient, names: N.Names) -> list[DeadLetter]:
    rows = await client.call(client.sync.xrange, names.stream(N.DEAD))
    return [decode(f[b"d"], DeadLetter) for _, f in rows]


async def test_retry_with_exponential_backoff_then_success(
    client: RedisClient, names: N.Names, autojump_clock: trio.testing.MockClock
) -> None:
    actor = Scripted(["fail", "fail", "ok"])
    policies = Policies(retry=RetryPolicy(max_retries=3, backoff_s=10.0, max_backoff_s=100.0))
    await _run_until_settled(client, names, actor, policies, [encode(_task())])
    assert len(actor.calls) == 3
    gaps = [b - a for a, b in zip(actor.calls, actor.calls[1:], strict=False)]
    assert gaps[0] <= 10.0 + 1e-6 and gaps[1] <= 20.0 + 1e-6  # full jitter under the caps
    assert await client.call(client.sync.xlen, names.stream(N.ROLLOUTS)) == 1
    assert await _dead(client, names) == []


async def test_retry_exhausted_goes_to_dead_letter(
    client: RedisClient, names: N.Names, autojump_clock: trio.testing.MockClock
) -> None:
    actor = Scripted(["fail"])
    policies = Policies(retry=RetryPolicy(max_retries=2, backoff_s=1.0))
    await _run_until_settled(client, names, actor, policies, [encode(_task())])
    assert len(actor.calls) == 3
    [letter] = await _dead(client, names)
    assert "failed 3 times" in letter.error and "boom" in letter.error
    assert await client.call(client.sync.xlen, names.stream(N.ROLLOUTS)) == 0


async def test_handler_requested_delay_is_honoured(
    client: RedisClient, names: N.Names, autojump_clock: trio.testing.MockClock
) -> None:
    actor = Scripted(["retry", "ok"])
    await _run_until_settled(client, names, actor, Policies(), [encode(_task())])
    assert actor.calls[1] - actor.calls[0] >= 100.0


async def test_time_limit_counts_as_failure(
    client: RedisClient, names: N.Names, autojump_clock: trio.testing.MockClock
) -> None:
    actor = Scripted(["hang"], hang_s=1000.0)
    policies = Policies(retry=RetryPolicy(max_retries=1, backoff_s=1.0), time_limit_s=30.0)
    await _run_until_settled(client, names, actor, policies, [encode(_task())])
    [letter] = await _dead(client, names)
    assert "time limit 30.0s exceeded" in letter.error
    assert len(actor.calls) == 2


async def test_unavailable_is_released_for_redelivery_not_dead_lettered(
    client: RedisClient, names: N.Names
) -> None:
    # Given a handler whose infrastructure is down for its first two deliveries
    actor = Scripted(["unavailable", "unavailable", "ok"])
    policies = Policies(retry=RetryPolicy(max_retries=0))
    await Producer(client, names).publish(N.TASKS, [encode(_task())])
    settings = ConsumerSettings(block_ms=50, reclaim_min_idle_ms=200, max_deliveries=5)
    fast = RuntimeSettings(concurrency=1, reclaim_interval_s=0.1)
    async with open_stream_consumer(client, names, N.TASKS, stage="s", settings=settings) as c:
        runtime = ActorRuntime(c, actor, policies, fast)
        async with trio.open_nursery() as nursery:
            await nursery.start(runtime.serve)
            await wait_until(lambda: runtime.statistics().handled, timeout=20)
            nursery.cancel_scope.cancel()
    # Then it was released twice (left pending, redelivered by the reclaimer), then handed off
    stats = runtime.statistics()
    assert (stats.released, stats.dead_lettered, stats.handled) == (2, 0, 1)
    assert len(actor.calls) == 3
    # not before the stream's min-idle (200 ms), which Redis counts from the delivery, a little
    # before the handler's call was recorded (and in whole milliseconds)
    assert actor.calls[1] - actor.calls[0] >= 0.15
    assert await _dead(client, names) == []
    assert await client.call(client.sync.xlen, names.stream(N.ROLLOUTS)) == 1
    info = await client.call(client.sync.xpending, names.stream(N.TASKS), c.group)
    assert info["pending"] == 0


class DrainsWhileDown(Scripted):
    """Infrastructure down on every call; the process starts draining (SIGTERM) during the
    first one."""

    runtime: ActorRuntime | None = None

    async def handle(self, task: Task) -> list[Output]:
        if self.runtime is not None and not self.calls:
            self.runtime.drain()
        return await super().handle(task)


async def test_a_draining_runtime_releases_unavailable_at_once_instead_of_retrying(
    client: RedisClient, names: N.Names
) -> None:
    # Given a handler whose infrastructure stays down, with 5 retries allowed
    actor = DrainsWhileDown(["unavailable"])
    policies = Policies(retry=RetryPolicy(max_retries=5))
    await Producer(client, names).publish(N.TASKS, [encode(_task())])
    settings = ConsumerSettings(block_ms=50)
    async with open_stream_consumer(client, names, N.TASKS, stage="s", settings=settings) as c:
        runtime = ActorRuntime(c, actor, policies, RuntimeSettings(concurrency=1))
        actor.runtime = runtime
        # When the process drains during the first attempt
        with trio.fail_after(30):
            await runtime.serve()
    # Then serve returned without the 5 retries (they would only hold the drain: a draining
    # process starts nothing), and the entry was released (still pending, for a reclaimer),
    # neither dead-lettered nor handed off
    assert len(actor.calls) == 1
    stats = runtime.statistics()
    assert (stats.released, stats.dead_lettered, stats.handled) == (1, 0, 0)
    assert await _dead(client, names) == []
    info = await client.call(client.sync.xpending, names.stream(N.TASKS), c.group)
    assert info["pending"] == 1


async def test_reject_dead_letters_without_retry(client: RedisClient, names: N.Names) -> None:
    actor = Scripted(["reject"])
    await _run_until_settled(client, names, actor, Policies(), [encode(_task())])
    assert len(actor.calls) == 1
    [letter] = await _dead(client, names)
    assert letter.error == "rejected: never valid"


async def test_malformed_input_dead_lettered_and_valid_traffic_flows(
    client: RedisClient, names: N.Names
) -> None:
    # Given garbage, a wrong type, a wrong schema version and two valid tasks
    wrong_version = encode(_task()).replace(b"\xa1v\x01", b"\xa1v\x07")
    bad = [b"\xc1\xc1\xc1", encode({"id": 3}), wrong_version]
    actor = Scripted(["ok"])
    await _run_until_settled(
        client,
        names,
        actor,
        Policies(),
        [bad[0], encode(_task(1)), bad[1], bad[2], encode(_task(2))],
    )
    # Then each bad one is dead-lettered with a reason, the valid ones are handled
    letters = await _dead(client, names)
    assert len(letters) == 3 and all("malformed message" in x.error for x in letters)
    assert any("schema version 7" in x.error for x in letters)
    assert len(actor.calls) == 2


async def test_redelivery_beyond_limit_is_dead_lettered(
    client: RedisClient, names: N.Names
) -> None:
    # Given an entry already delivered (and never acked) max_deliveries times
    await Producer(client, names).publish(N.TASKS, [encode(_task())])
    settings = ConsumerSettings(reclaim_min_idle_ms=1)
    async with open_stream_consumer(client, names, N.TASKS, stage="s", settings=settings) as c:
        await c.read(1)
        for _ in range(2):  # (once idle past its 1 ms)
            await wait_until(lambda: c.reclaim(1), 10, what="the entry was not reclaimed")
    # When a runtime picks it up again (its delivery count is now 4 > 3), through a consumer
    # that applies the delivery limit (the one place it is applied)
    actor = Scripted(["ok"])
    limited = dataclasses.replace(settings, max_deliveries=3)
    async with open_stream_consumer(client, names, N.TASKS, stage="s", settings=limited) as c:
        runtime = ActorRuntime(
            c, actor, Policies(), RuntimeSettings(concurrency=1, reclaim_interval_s=0.05)
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(runtime.serve)
            await wait_until(lambda: runtime.statistics().dead_lettered, timeout=20)
            nursery.cancel_scope.cancel()
    # Then it is dead-lettered without being handled
    assert actor.calls == []
    [letter] = await _dead(client, names)
    assert "delivered 4 times" in letter.error


async def test_oversize_output_dead_letters_its_input(client: RedisClient, names: N.Names) -> None:
    class Bloater(Scripted):
        async def handle(self, task: Task) -> list[Output]:
            return [Output(N.ROLLOUTS, msgspec.structs.replace(task, prompt="x" * 5000))]

    await Producer(client, names).publish(N.TASKS, [encode(_task())])
    small = PayloadLimits(max_bytes=1000, claim_check_bytes=500)
    settings = ConsumerSettings(block_ms=50, limits=small)
    async with open_stream_consumer(client, names, N.TASKS, stage="s", settings=settings) as c:
        runtime = ActorRuntime(c, Bloater([]), Policies(), RuntimeSettings(concurrency=1))
        async with trio.open_nursery() as nursery:
            await nursery.start(runtime.serve)
            await wait_until(lambda: runtime.statistics().dead_lettered, timeout=20)
            nursery.cancel_scope.cancel()
    [letter] = await _dead(client, names)
    assert "output refused" in letter.error and "over the limit of 1000" in letter.error
    assert await client.call(client.sync.exists, names.stream(N.ROLLOUTS)) == 0


async def test_reading_pauses_while_the_downstream_group_is_backlogged(
    client: RedisClient, names: N.Names
) -> None:
    # Given a downstream group (executor on rollouts) with 3 entries waiting, bound 2
    await ensure_group(client, names.stream(N.ROLLOUTS), "executor")
    await Producer(client, names).publish(N.ROLLOUTS, [b"r"] * 3)
    await Producer(client, names).publish(N.TASKS, [encode(_task(i)) for i in range(2)])
    settings = RuntimeSettings(
        concurrency=2,
        downstream=(N.ROLLOUTS, "executor"),
        max_downstream_backlog=2,
        backpressure_poll_s=0.05,
    )
    actor = Scripted(["ok"])
    consumer_settings = ConsumerSettings(block_ms=50)
    async with open_stream_consumer(
        client, names, N.TASKS, stage="s", settings=consumer_settings
    ) as c:
        runtime = ActorRuntime(c, actor, Policies(), settings)
        async with trio.open_nursery() as nursery:
            await nursery.start(runtime.serve)
            # Then it pauses before reading (it says so in Redis, for `streamrl status`), and
            # nothing is read while the backlog is over the bound
            [paused] = await wait_until(lambda: paused_stages(client, names, ["scripted"]), 10,
                                        what="the runtime did not pause on the backlog")
            assert (paused.downstream, paused.backlog, paused.limit) == (N.ROLLOUTS, 3, 2)
            assert actor.calls == [] and c.statistics_counts["read_calls"] == 0
            # When the downstream consumer catches up, the tasks flow
            rows = await client.call(
                client.sync.xreadgroup, "executor", "x", {names.stream(N.ROLLOUTS): ">"}
            )
            ids = [eid for eid, _ in rows[0][1]]
            await client.call(client.sync.xack, names.stream(N.ROLLOUTS), "executor", *ids)
            await wait_until(lambda: runtime.statistics().handled >= 2, timeout=10)
            nursery.cancel_scope.cancel()
