"""Per-role ACL users against a real Redis: each role can do its own part and nothing else."""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis
import trio

from streamrl.protocol import names as N
from streamrl.protocol.pipeline import pipeline_state
from streamrl.protocol.roles import ROLES, acl_rules, apply_acls
from streamrl.queues.acl import Credentials, role_url
from streamrl.queues.client import Reconnect, RedisClient
from streamrl.queues.payloads import PayloadLimits
from streamrl.queues.server import ClusterProcess
from streamrl.queues.shards import open_sharded_consumer, publish_routed
from streamrl.queues.stats import group_state, stream_length
from streamrl.queues.streams import (
    ConsumerSettings,
    EventReader,
    Handoff,
    Producer,
    ensure_group,
    open_stream_consumer,
)
from tests.helpers import role_credentials

LIMITS = PayloadLimits(claim_check_bytes=64)  # payloads over 64 bytes go through blob keys
BIG = b"x" * 200


async def _denied(call: Callable[[], Awaitable[Any]]) -> None:
    with pytest.raises(redis.ResponseError, match=r"(?i)no permissions|can.t run this command"):
        await call()


def _dryrun(client: RedisClient, user: str, *command: str) -> str:
    """What Redis answers ``user`` running ``command``, without running it (ACL DRYRUN)."""
    try:
        reply = client.sync.execute_command("ACL", "DRYRUN", user, *command)
    except redis.ResponseError as exc:
        return str(exc)
    return reply.decode() if isinstance(reply, bytes) else str(reply)


def _refusals(client: RedisClient, names: N.Names) -> list[str]:
    """What Redis refused the users of this run (ACL LOG), also where the caller tolerated it."""
    log = client.sync.acl_log(count=128)
    return [f"{e['username']}: {e['object']}" for e in log if names.run in e["username"]]


# ---------------------------------------------------------------------- the generator's limits
async def test_generator_cannot_write_trajectories(
    client: RedisClient, names: N.Names, roles: dict[str, RedisClient]
) -> None:
    gen = roles["generator"]
    await Producer(client, names).publish(N.TASKS, [b"task"])
    trajectories = names.stream(N.TRAJECTORIES)
    # When the generator adds to the learner's input, directly or through its hand-off script
    await _denied(lambda: gen.execute("XADD", trajectories, "*", "d", b"forged"))
    async with open_stream_consumer(gen, names, N.TASKS, stage="generator") as consumer:
        [d] = await consumer.read(1)
        forged = [(trajectories, b"forged")]
        dedup = names.dedup("generator", "t1")
        await _denied(lambda: consumer.ack_many([d.entry_id], dedup, forged))
    # Then nothing reached the learner
    assert await client.call(client.sync.xlen, trajectories) == 0


@pytest.mark.parametrize(
    "command",
    [
        ("XRANGE", "{trajectories}", "-", "+"),
        ("XREVRANGE", "{trajectories}", "+", "-"),
        ("XREADGROUP", "GROUP", "learner", "c", "STREAMS", "{trajectories}", ">"),
        ("XLEN", "{trajectories}"),
        ("XINFO", "GROUPS", "{trajectories}"),
        ("XADD", "{weights}", "*", "d", "forged"),
        ("XREAD", "STREAMS", "{metrics}", "0"),
        ("GET", "{dropped_stale}"),
        ("INCR", "{dropped_stale}"),
        ("SET", "{dedup_learner}", "1"),
        ("GET", "{trajectory_blob}"),
    ],
    ids=lambda c: " ".join(c[:2]),
)
async def test_generator_cannot_touch_the_learners_keys(
    client: RedisClient, names: N.Names, roles: dict[str, RedisClient], command: tuple[str, ...]
) -> None:
    await ensure_group(client, names.stream(N.TRAJECTORIES), "learner")
    await client.execute("XADD", names.stream(N.TRAJECTORIES), "*", "d", b"group")
    keys = {
        "{trajectories}": names.stream(N.TRAJECTORIES),
        "{weights}": names.stream(N.WEIGHTS),
        "{metrics}": names.stream(N.METRICS),
        "{dropped_stale}": names.counter("dropped_stale"),
        "{dedup_learner}": names.dedup("learner", "step-1"),
        "{trajectory_blob}": names.stream(N.TRAJECTORIES) + ":blob:0",
    }
    await _denied(lambda: roles["generator"].execute(*(keys.get(a, a) for a in command)))


@pytest.mark.parametrize(
    "command",
    [
        ("FLUSHALL",),
        ("FLUSHDB",),
        ("CONFIG", "GET", "requirepass"),
        ("CONFIG", "SET", "appendonly", "no"),
        ("KEYS", "*"),
        ("SCAN", "0"),
        ("ACL", "SETUSER", "intruder", "on", ">x", "+@all", "~*"),
        ("ACL", "LIST"),
        ("SHUTDOWN", "NOSAVE"),
        ("DEBUG", "SLEEP", "0"),
        ("SCRIPT", "FLUSH"),
        ("CLIENT", "KILL", "TYPE", "normal"),
        ("MONITOR",),
        ("PUBLISH", "channel", "x"),
    ],
    ids=lambda c: " ".join(c[:2]),
)
async def test_generator_cannot_run_admin_commands(
    client: RedisClient, names: N.Names, roles: dict[str, RedisClient], command: tuple[str, ...]
) -> None:
    # Redis's own check, without running the command (a wrong ACL must not flush the test Redis)
    reply = _dryrun(client, f"streamrl-{names.run}-generator", *command)
    assert "no permissions" in reply


@pytest.mark.parametrize("command", [("FLUSHALL",), ("CONFIG", "GET", "*"), ("KEYS", "*")])
async def test_generator_is_refused_admin_commands_for_real(
    roles: dict[str, RedisClient], command: tuple[str, ...]
) -> None:
    await _denied(lambda: roles["generator"].execute(*command))


async def test_a_script_cannot_do_more_than_its_caller(roles: dict[str, RedisClient]) -> None:
    gen = roles["generator"]
    await _denied(lambda: gen.execute("EVAL", "return redis.call('FLUSHALL')", 0))
    await _denied(lambda: gen.execute("EVAL", "return redis.call('KEYS', '*')", 0))


async def test_roles_cannot_touch_another_run(
    client: RedisClient, names: N.Names, roles: dict[str, RedisClient]
) -> None:
    other = N.Names(run=names.run + "x")  # shares the prefix of this run's name
    await Producer(client, other).publish(N.TASKS, [b"theirs"])
    gen = roles["generator"]
    await _denied(lambda: ensure_group(gen, other.stream(N.TASKS), "generator"))
    await _denied(lambda: gen.execute("XRANGE", other.stream(N.TASKS), "-", "+"))
    await _denied(lambda: gen.execute("XADD", other.stream(N.ROLLOUTS), "*", "d", b"x"))
    await _denied(lambda: roles["learner"].execute("XADD", other.stream(N.WEIGHTS), "*", "d", b"x"))


async def test_glob_characters_in_a_run_name_match_only_themselves(
    client: RedisClient, names: N.Names
) -> None:
    run = N.Names(run=names.run + "*")
    creds = {"generator": Credentials(f"streamrl-{names.run}-glob", secrets.token_hex(16))}
    await apply_acls(client, run, creds)
    gen = RedisClient(role_url(client.url.url, creds["generator"]))
    try:
        lookalike = N.Names(run=names.run + "zz")
        await _denied(lambda: gen.execute("XACK", lookalike.stream(N.TASKS), "generator", "0-1"))
        await gen.execute("XACK", run.stream(N.TASKS), "generator", "0-1")  # its own: allowed
    finally:
        gen.close()
        client.sync.execute_command("ACL", "DELUSER", creds["generator"].user)


# ---------------------------------------------------------------------- each role's own work
@pytest.mark.parametrize(
    ("role", "stream", "outputs"),
    [
        ("generator", N.TASKS, (N.ROLLOUTS,)),
        ("executor", N.ROLLOUTS, (N.EXECUTED,)),
        ("verifier", N.EXECUTED, (N.TRAJECTORIES, N.EVALS)),
        ("learner", N.TRAJECTORIES, (N.WEIGHTS, N.METRICS)),
        ("monitor", N.EVALS, ()),
    ],
)
async def test_each_stage_consumes_and_hands_off_with_its_own_user(
    client: RedisClient,
    names: N.Names,
    roles: dict[str, RedisClient],
    role: str,
    stream: str,
    outputs: tuple[str, ...],
) -> None:
    # Given three entries in the stage's input, one of them behind a claim check
    await Producer(client, names, LIMITS).publish(stream, [b"small", BIG, b"bad"])
    settings = ConsumerSettings(reclaim_min_idle_ms=0, limits=LIMITS, retain_acked=0)
    async with open_stream_consumer(
        roles[role], names, stream, stage=role, settings=settings
    ) as consumer:
        # When the role reads, heartbeats, reclaims, hands off, dead-letters and trims
        first = await consumer.read(10)
        assert [d.payload for d in first] == [b"small", BIG, b"bad"]
        await consumer.heartbeat([d.entry_id for d in first])
        again = await consumer.reclaim(10)
        assert len(again) == 3
        for i, d in enumerate(first[:2]):
            out = [(names.stream(s), BIG if i else b"out") for s in outputs]
            await consumer.complete(Handoff(d.entry_id, names.dedup(role, f"m{i}"), out))
        await consumer.dead_letter(first[2], "bad input")
        for s in outputs:  # backpressure: the backlog of the groups it feeds
            if s in N.WORK_STREAMS:
                await group_state(roles[role], names, s, N.GROUP_OF_STREAM[s])
        assert await consumer.trim() > 0  # acknowledged entries and their blobs deleted
    # Then every output is there once, nothing is pending, nothing was refused
    assert _refusals(client, names) == []
    for s in outputs:
        assert await client.call(client.sync.xlen, names.stream(s)) == 2
    state = await group_state(client, names, stream, N.GROUP_OF_STREAM[stream])
    assert state.pending == 0
    assert await stream_length(client, names, N.DEAD) == 1


async def test_scheduler_publishes_tasks_and_reads_the_backlog(
    client: RedisClient, names: N.Names, roles: dict[str, RedisClient]
) -> None:
    sched = roles["scheduler"]
    await ensure_group(client, names.stream(N.TASKS), "generator")
    producer = Producer(sched, names, LIMITS)
    # admission: tasks and the admitted counter together; evaluation rounds; blobs
    assert await producer.publish_counted(N.TASKS, [b"t1", b"t2"], names.admitted, 0) == 2
    await producer.publish(N.TASKS, [BIG])
    assert int(await sched.call(sched.sync.get, names.admitted)) == 2
    assert await sched.call(sched.sync.incr, names.eval_round) == 1
    assert not await sched.call(sched.sync.exists, names.stop)
    state = await group_state(sched, names, N.TASKS, "generator")
    assert state.backlog == 3
    reader = EventReader(sched, names, N.WEIGHTS, block_ms=50)
    try:
        assert await reader.latest() is None
        assert await reader.read() == []
    finally:
        reader.close()
    assert _refusals(client, names) == []
    # but it neither consumes its own output nor touches anything downstream
    await _denied(lambda: ensure_group(sched, names.stream(N.TASKS), "generator"))
    await _denied(lambda: sched.execute("XADD", names.stream(N.ROLLOUTS), "*", "d", b"x"))
    await _denied(lambda: sched.call(sched.sync.set, names.stop, 1))


async def test_learner_publishes_weights_that_the_generator_follows(
    client: RedisClient, names: N.Names, roles: dict[str, RedisClient]
) -> None:
    await Producer(client, names).publish(N.TRAJECTORIES, [b"g1", b"g2"])
    learner, gen = roles["learner"], roles["generator"]
    async with open_stream_consumer(learner, names, N.TRAJECTORIES, stage="learner") as consumer:
        batch = await consumer.read(2)
        assert await learner.call(learner.sync.incr, names.counter("dropped_stale")) == 1
        await learner.call(learner.sync.xtrim, names.stream(N.WEIGHTS), maxlen=100)
        outputs = [(names.stream(N.WEIGHTS), b"v1"), (names.stream(N.METRICS), BIG)]
        await consumer.ack_many(
            [d.entry_id for d in batch], names.dedup("learner", "step-1"), outputs
        )
    reader = EventReader(gen, names, N.WEIGHTS, block_ms=50)
    try:
        latest = await reader.latest()
        assert latest is not None and latest[1] == b"v1"
    finally:
        reader.close()
    await _denied(lambda: gen.execute("XRANGE", names.stream(N.METRICS), "-", "+"))


async def test_sharded_run_each_role_reaches_every_shard(
    client: RedisClient, names: N.Names
) -> None:
    # Given a run whose work streams are split in two shards, and its users
    credentials = role_credentials(names)
    await apply_acls(client, names, credentials, shards=2)
    gen = RedisClient(role_url(client.url.url, credentials["generator"]))
    learner = RedisClient(role_url(client.url.url, credentials["learner"]))
    try:
        items = [("a", b"t0"), ("b", b"t1"), ("c", b"t2"), ("d", b"t3")]
        await publish_routed(client, names, N.TASKS, items, shards=2)
        await publish_routed(client, names, N.TRAJECTORIES, items, shards=2)
        # When the generator hands off in both shards and the learner announces a step
        # over groups of both shards (cross-slot: publish once, then acknowledge per shard)
        async with open_sharded_consumer(gen, names, N.TASKS, (0, 1), stage="generator") as c:
            got = []
            while len(got) < 4:
                got += await c.read(4)
            for i, d in enumerate(got):
                out = [(names.stream(N.ROLLOUTS), b"r")]
                await c.complete(Handoff(d.entry_id, names.dedup("generator", str(i)), out))
        async with open_sharded_consumer(
            learner, names, N.TRAJECTORIES, (0, 1), stage="learner"
        ) as c:
            got = []
            while len(got) < 4:
                got += await c.read(4)
            outputs = [(names.stream(N.WEIGHTS), b"v1"), (names.stream(N.METRICS), b"m1")]
            await c.ack_many([d.entry_id for d in got], names.dedup("learner", "s1"), outputs)
        # Then everything went where it belongs, and the shards of another run stay closed
        rollouts = [names.in_shard(k).stream(N.ROLLOUTS) for k in (0, 1)]
        assert sum([await client.call(client.sync.xlen, k) for k in rollouts]) == 4
        assert await client.call(client.sync.xlen, names.stream(N.WEIGHTS)) == 1
        other = N.Names(run=names.run + "x", shard=0)
        await _denied(lambda: gen.execute("XRANGE", other.stream(N.TASKS), "-", "+"))
    finally:
        gen.close()
        learner.close()
        users = [c.user for c in credentials.values()]
        client.sync.execute_command("ACL", "DELUSER", *users)


async def test_role_users_on_a_redis_cluster(redis_cluster: ClusterProcess, names: N.Names) -> None:
    # Given the users created through a cluster client (ACL SETUSER goes to every node)
    admin = RedisClient(redis_cluster.url)
    credentials = role_credentials(names)
    try:
        await apply_acls(admin, names, credentials)
        await Producer(admin, names).publish(N.TASKS, [b"task"])
        gen = RedisClient(role_url(redis_cluster.url, credentials["generator"]))
        try:
            # When the generator hands off (cluster pipelines send scripts as EVAL) and
            # follows the weights with a blocking read on the node owning the stream
            async with open_stream_consumer(gen, names, N.TASKS, stage="generator") as c:
                [d] = await c.read(1)
                out = [(names.stream(N.ROLLOUTS), b"r")]
                await c.complete(Handoff(d.entry_id, names.dedup("generator", "1"), out))
            reader = EventReader(gen, names, N.WEIGHTS, block_ms=30_000)
            try:
                with trio.move_on_after(0.3):
                    await reader.read()
            finally:
                reader.close()
            # Then it worked, and the generator is as limited there as on one server
            assert await admin.call(admin.sync.xlen, names.stream(N.ROLLOUTS)) == 1
            for node in redis_cluster.nodes:  # nothing refused, not even tolerated refusals
                node_client = RedisClient(node.url)
                assert _refusals(node_client, names) == []
                node_client.close()
            await _denied(lambda: gen.execute("XADD", names.stream(N.TRAJECTORIES), "*", "d", b"x"))
        finally:
            gen.close()
    finally:
        users = [c.user for c in credentials.values()]
        admin.sync.execute_command("ACL", "DELUSER", *users)
        admin.close()


async def test_a_blocking_read_is_cancelled_with_the_roles_own_connection(
    names: N.Names, roles: dict[str, RedisClient]
) -> None:
    # CLIENT ID / CLIENT UNBLOCK are allowed: a cancelled 30 s read returns at once
    reader = EventReader(roles["generator"], names, N.WEIGHTS, block_ms=30_000)
    try:
        start = trio.current_time()
        with trio.move_on_after(0.3):
            await reader.read()
        assert trio.current_time() - start < 5
    finally:
        reader.close()


async def test_monitor_observes_and_runs_the_final_evaluation(
    client: RedisClient, names: N.Names, roles: dict[str, RedisClient]
) -> None:
    mon = roles["monitor"]
    for stream in N.WORK_STREAMS:
        await ensure_group(client, names.stream(stream), N.GROUP_OF_STREAM[stream])
    await Producer(client, names).publish(N.TRAJECTORIES, [b"g"])
    await Producer(client, names).publish(N.METRICS, [b"m"])
    # progress: every queue's backlog, dead letters, the learner's metrics, the policy version
    states = {s.stream: s for s in await pipeline_state(mon, names)}
    assert states[N.TRAJECTORIES].lag == 1
    assert await stream_length(mon, names, N.DEAD) == 0
    metrics = EventReader(mon, names, N.METRICS, block_ms=50)
    weights = EventReader(mon, names, N.WEIGHTS, block_ms=50)
    try:
        assert [p for _, p in await metrics.read()] == [b"m"]
        assert await weights.latest() is None
    finally:
        metrics.close()
        weights.close()
    # the final evaluation: stop admission, a new round of tasks
    await mon.call(mon.sync.set, names.stop, 1)
    assert await mon.call(mon.sync.incr, names.eval_round) == 1
    await Producer(mon, names, LIMITS).publish(N.TASKS, [b"eval", BIG])
    # but it cannot take or add training data
    await _denied(lambda: ensure_group(mon, names.stream(N.TRAJECTORIES), "learner"))
    await _denied(lambda: mon.execute("XADD", names.stream(N.TRAJECTORIES), "*", "d", b"x"))


# ---------------------------------------------------------------------- applying the users
async def test_apply_is_idempotent_and_rotates_passwords(
    client: RedisClient, names: N.Names, roles: dict[str, RedisClient]
) -> None:
    user = f"streamrl-{names.run}-executor"
    before = client.sync.execute_command("ACL", "GETUSER", user)
    old = roles["executor"].url
    # When the users are applied again with a new password for the executor
    new = Credentials(user, secrets.token_hex(16))
    await apply_acls(client, names, {"executor": new})
    # Then its rules are unchanged, the new password works and the old one does not
    assert client.sync.execute_command("ACL", "GETUSER", user)[b"selectors"] == before[b"selectors"]
    fresh = RedisClient(role_url(client.url.url, new))
    stale = RedisClient(old, reconnect=Reconnect(timeout_s=0))
    try:
        assert await fresh.execute("PING")
        with pytest.raises(redis.AuthenticationError):
            await stale.execute("PING")
    finally:
        fresh.close()
        stale.close()


def test_rules_reach_only_the_runs_keys_and_never_all_commands() -> None:
    names = N.Names(run="r")
    for role in ROLES:
        rules = acl_rules(names, role, "pw")
        assert "pw" not in " ".join(rules)  # only its SHA-256
        assert rules[:6] == ["reset", "on", rules[2], "resetkeys", "resetchannels", "-@all"]
        text = " ".join(rules)
        for token in text.replace("(", " ").replace(")", " ").split():
            assert not token.startswith("+@") and token not in ("allkeys", "allcommands", "~*")
            if "~" in token:
                assert token.split("~", 1)[1].startswith("streamrl:{r}:"), (role, token)
    with pytest.raises(ValueError, match="unknown role"):
        acl_rules(names, "superuser", "pw")


async def test_users_survive_a_restart_of_the_embedded_server(tmp_path: Any) -> None:
    # Given the embedded server (it has an ACL file) with the run's users applied
    from streamrl.queues.server import ServerProcess

    names = N.Names(run="restart")
    credentials = role_credentials(names)
    with ServerProcess(tmp_path / "redis") as server:
        admin = RedisClient(server.url)
        try:
            await apply_acls(admin, names, credentials)
        finally:
            admin.close()
        # When the server restarts
        server.stop()
        server.start()
        # Then a role's user still logs in with its rules, and the admin password still holds
        learner = RedisClient(role_url(server.url, credentials["learner"]), reconnect=Reconnect(0))
        generator = RedisClient(role_url(server.url, credentials["generator"]))
        try:
            assert await learner.execute("PING")
            await _denied(lambda: generator.execute("FLUSHALL"))
        finally:
            learner.close()
            generator.close()
        anonymous = redis.Redis(host="127.0.0.1", port=server.port)
        with pytest.raises(redis.AuthenticationError):
            anonymous.ping()
        anonymous.close()


@pytest.mark.parametrize("stream", [N.TRAJECTORIES, N.EVALS])
async def test_archiver_reads_in_its_own_group_and_writes_nothing(
    client: RedisClient, names: N.Names, roles: dict[str, RedisClient], stream: str
) -> None:
    archiver = roles["archiver"]
    await Producer(client, names, LIMITS).publish(stream, [b"one", BIG])
    settings = ConsumerSettings(reclaim_min_idle_ms=0, limits=LIMITS)
    # When the archiver reads both entries (one behind a claim check) in its own group, acks
    async with open_stream_consumer(
        archiver, names, stream, stage="archiver", group="archiver", settings=settings
    ) as consumer:
        got = await consumer.read(10)
        assert [d.payload for d in got] == [b"one", BIG]
        await consumer.ack([d.entry_id for d in got])
    await EventReader(archiver, names, N.METRICS).latest()
    for s in (*N.WORK_STREAMS, N.DEAD):
        await stream_length(archiver, names, s)
    assert _refusals(client, names) == []
    # Then it may add to no stream, read no weights, and run no admin command
    await _denied(lambda: archiver.execute("XADD", names.stream(stream), "*", "d", b"x"))
    await _denied(lambda: archiver.execute("XREVRANGE", names.stream(N.WEIGHTS), "+", "-"))
    await _denied(lambda: archiver.execute("FLUSHALL"))


async def test_verifier_counts_and_scheduler_reads_the_domain_counters(
    client: RedisClient, names: N.Names, roles: dict[str, RedisClient]
) -> None:
    keys = [names.counter(k) for k in ("zero_variance", "resolved:math", "trained:math")]
    for key in keys:  # dynamic sampling and the per-domain shares (actors/verifier.py)
        await roles["verifier"].execute("INCRBY", key, 2)
    assert await roles["scheduler"].execute("MGET", *keys) == [b"2", b"2", b"2"]
    assert await roles["scheduler"].execute("GET", keys[0]) == b"2"
    assert _refusals(client, names) == []
    await _denied(lambda: roles["scheduler"].execute("INCRBY", keys[0], 1))
    await _denied(lambda: roles["verifier"].execute("GET", keys[0]))
    await _denied(lambda: roles["generator"].execute("INCRBY", keys[0], 1))
