"""The operator's ``admin`` role (protocol/roles.py): ``streamrl status``, ``dlq list|show|requeue|
purge``, a live ``replay`` selection and the report's reads run end to end as the run's own
admin user, on one shard and on two; the same user is refused every administrative command
and every key of another run."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import trio

import streamrl.domains.arith.domain  # noqa: F401  (registers the arith domain)
from streamrl.actors.verifier import Verifier
from streamrl.cli.report import collect
from streamrl.cli.status import ops_client
from streamrl.config.schema import Config
from streamrl.protocol import names as N
from streamrl.protocol.messages import Task, Trajectory, WeightsPublished, new_id, now
from streamrl.protocol.roles import ROLES
from streamrl.queues.acl import Credentials, role_url
from streamrl.queues.client import RedisClient, RedisURL
from streamrl.queues.codec import DeadLetter, encode
from streamrl.queues.payloads import REF_PREFIX, PayloadLimits, resolve
from streamrl.queues.server import ClusterProcess
from streamrl.queues.streams import Producer, StreamConsumer, ensure_group, requeue_dead_letter
from streamrl.runtime.auth import apply_role_users, credentials_for_up, ops_url
from tests.ops.helpers import config as ops_config
from tests.ops.helpers import executed

LIMITS = PayloadLimits(claim_check_bytes=64)  # every trajectory behind a claim-check blob


@pytest.fixture(params=[1, 2], ids=["one-shard", "two-shards"])
def shards(request: pytest.FixtureRequest) -> int:
    return int(request.param)


@pytest.fixture
def run_names(names: N.Names, shards: int) -> N.Names:
    return N.Names(names.run, shards=shards)


@contextlib.contextmanager
def _admin_users(
    superuser: RedisClient, run_names: N.Names, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Config, Credentials]]:
    """The run's users as `streamrl up` creates them (the admin's password from
    $STREAMRL_PASSWORD_ADMIN), and the run's config with auth on and a Redis URL without
    credentials: a command that works got in as the admin role, not as the URL's user."""
    password = secrets.token_hex(16)
    monkeypatch.setenv("STREAMRL_PASSWORD_ADMIN", password)
    monkeypatch.delenv("STREAMRL_REDIS_URL", raising=False)
    bare = RedisURL(superuser.url.url).without_credentials().url
    cfg = ops_config(tmp_path, bare, run_names.run, "auth.enabled=true",
                     f"queues.shards={run_names.shards}")  # fmt: skip
    credentials = credentials_for_up(cfg, {"STREAMRL_PASSWORD_ADMIN": password})
    trio.run(apply_role_users, cfg, superuser.url.url, credentials)
    try:
        yield cfg, credentials["admin"]
    finally:
        on_all = {"target_nodes": "all"} if superuser.url.cluster else {}
        users = [c.user for c in credentials.values()]
        superuser.sync.execute_command("ACL", "DELUSER", *users, **on_all)


@pytest.fixture
def admin(
    redis_url: str, run_names: N.Names, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Config, Credentials]]:
    superuser = RedisClient(redis_url)
    try:
        with _admin_users(superuser, run_names, tmp_path, monkeypatch) as admin:
            yield admin
    finally:
        superuser.close()


def _argv(cfg: Config, *args: str) -> list[str]:
    sets = [f"run.name={cfg.run.name}", f"run.redis_url={cfg.run.redis_url}",
            f"run.work_dir={cfg.run.work_dir}", "auth.enabled=true",
            f"queues.shards={cfg.queues.shards}"]  # fmt: skip
    return [*args, *(a for s in sets for a in ("--set", s))]


def _streamrl(cfg: Config, *args: str, **env: str) -> tuple[int, str, str]:
    """``streamrl ARGS`` for run ``cfg``, a process of its own (the real entry point), with
    ``env`` added to this environment."""
    done = subprocess.run([sys.executable, "-m", "streamrl", *_argv(cfg, *args)],
                          env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    return done.returncode, done.stdout, done.stderr


def _refusals(client: RedisClient, user: str) -> list[str]:
    """What Redis refused ``user`` (ACL LOG), also where the caller tolerated it."""
    log = client.sync.acl_log(count=128)
    return [f"{e['reason']}: {e['object']}" for e in log if e["username"] == user]


def _letter(stream: str, payload: bytes, error: str) -> dict[str, bytes | str]:
    letter = DeadLetter(stream=stream, group=N.GROUP_OF_STREAM[stream], entry_id="1-0",
                        error=error, deliveries=5, payload=payload, at=now())  # fmt: skip
    return {"d": encode(letter), "error": error}


@pytest.mark.system  # eight CLI processes
async def test_admin_runs_status_dlq_and_replay_on_its_run(
    client: RedisClient,
    run_names: N.Names,
    admin: tuple[Config, Credentials],
) -> None:
    await _operate(client, run_names, admin[0])
    # Nothing was refused, not even where a caller tolerates it
    assert _refusals(client, admin[1].user) == []


@pytest.fixture
def cluster_run(
    redis_cluster: ClusterProcess, names: N.Names, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[RedisClient, N.Names, Config, Credentials]]:
    """A 3-shard run on the 3-node cluster, its users set on every node."""
    run_names = N.Names(names.run, shards=3)
    client = RedisClient(redis_cluster.url)
    try:
        with _admin_users(client, run_names, tmp_path, monkeypatch) as (cfg, creds):
            yield client, run_names, cfg, creds
    finally:
        client.close()


@pytest.mark.system  # a 3-node cluster, eight CLI processes
async def test_admin_runs_status_dlq_and_replay_on_a_redis_cluster(
    redis_cluster: ClusterProcess,
    cluster_run: tuple[RedisClient, N.Names, Config, Credentials],
) -> None:
    # The operator client follows the slots, its pipelines send scripts as EVAL
    client, run_names, cfg, creds = cluster_run
    await _operate(client, run_names, cfg)
    for node in redis_cluster.nodes:
        node_client = RedisClient(node.url)
        try:
            assert _refusals(node_client, creds.user) == [], node.port
        finally:
            node_client.close()


async def _operate(client: RedisClient, run_names: N.Names, cfg: Config) -> None:
    """status, dlq list/show/requeue/purge, replay list and the report's reads, as the admin
    of ``run_names``; ``client`` (the URL's superuser) sets the run up and checks."""
    layouts = run_names.layouts()
    first, last = layouts[0], layouts[-1]
    # Given a run with, in every shard, one verified group (behind a claim check) and one
    # executed group held by a verifier; the policy at v3; and three dead letters: one
    # executed group (a training group's), one task over the 1 MiB claim-check size, one rollout
    trajectories: list[Trajectory] = []
    for layout in layouts:
        group = executed("7", ["7", "8"])
        verified, *_ = await Verifier().handle(group)  # the output, then its counters
        assert isinstance(verified.message, Trajectory)
        trajectories.append(verified.message)
        await Producer(client, layout, LIMITS).publish(N.TRAJECTORIES, [encode(verified.message)])
        await Producer(client, layout).publish(N.EXECUTED, [encode(group)])
        await ensure_group(client, layout.stream(N.EXECUTED), "verifier")
        held = StreamConsumer(client, layout, N.EXECUTED, "verifier", stage="verifier",
                              consumer="verifier-1")  # fmt: skip
        await held.read(1)
        held.close()
    weights = WeightsPublished(id=new_id(), created_at=now(), policy_version=3, version=3,
                               path="/w/v3")  # fmt: skip
    await Producer(client, run_names).publish(N.WEIGHTS, [encode(weights)])
    poison = executed("42", ["42"])
    big = Task(id=new_id(), created_at=now(), policy_version=0, domain="arith",
               item_id="arith-train-big", split="train", prompt="x" * (1024 * 1024 + 10),
               spec={}, group_size=2, sampling=poison.rollout.task.sampling)  # fmt: skip
    dead = {
        "executed": (first, {**_letter(N.EXECUTED, encode(poison), "boom"), "group": "1"}),
        "tasks": (last, _letter(N.TASKS, encode(big), "too big")),
        "rollouts": (first, _letter(N.ROLLOUTS, encode(poison.rollout), "no sandbox")),
    }
    for layout, fields in dead.values():
        await client.call(client.sync.xadd, layout.stream(N.DEAD), fields)

    # When the operator runs `streamrl status` with the admin's password in the environment
    rc, out, err = _streamrl(cfg, "status", "--json", "--samples", "1")
    # Then it sees every shard: the policy version, the held groups, the dead letters
    assert rc == 0, err
    status = json.loads(out)
    groups = {g["stream"]: g for g in status["groups"]}
    assert (status["policy_version"], status["dead_letters"]) == (3, 3)
    assert groups[N.EXECUTED]["pending"] == len(layouts)
    assert [(c["name"], c["pending"]) for c in groups[N.EXECUTED]["consumers"]] == [
        ("verifier-1", len(layouts))
    ]
    assert (groups[N.TRAJECTORIES]["length"], groups[N.EXECUTED]["dead_letters"]) == (
        len(layouts), 1)  # fmt: skip

    # `streamrl dlq list` and `show`
    rc, out, err = _streamrl(cfg, "dlq", "list", "--json")
    assert rc == 0, err
    ids = {e["stream"]: e["id"] for e in json.loads(out)}
    assert set(ids) == set(dead)
    rc, out, err = _streamrl(cfg, "dlq", "show", ids[N.EXECUTED])
    assert rc == 0, err
    [shown] = json.loads(out)
    assert shown["error"] == "boom" and shown["payload"]["type"] == "Executed"

    # `streamrl dlq requeue` by id, and by stream (the big task goes through a claim check)
    rc, out, err = _streamrl(cfg, "dlq", "requeue", ids[N.EXECUTED])
    assert rc == 0, err
    assert await client.call(client.sync.xlen, first.stream(N.EXECUTED)) == 2
    rc, out, err = _streamrl(cfg, "dlq", "requeue", "--stream", "tasks")
    assert rc == 0, err
    rows: Any = await client.call(client.sync.xrange, last.stream(N.TASKS))
    [requeued] = await client.call(
        resolve, client.sync, [(e.decode(), f[b"d"]) for e, f in rows], PayloadLimits())
    assert requeued.payload == encode(big) and requeued.raw != requeued.payload  # a blob
    # `streamrl dlq purge` of what is left
    rc, out, err = _streamrl(cfg, "dlq", "purge", "--all", "--yes")
    assert (rc, out.strip()) == (0, "deleted 1 dead letter(s)"), err
    for layout in layouts:
        assert await client.call(client.sync.xlen, layout.stream(N.DEAD)) == 0

    # `streamrl replay list` from the live streams: every shard's group, blobs resolved
    rc, out, err = _streamrl(cfg, "replay", "list", "--source", "live",
                                   "--stream", "trajectories")  # fmt: skip
    assert rc == 0, err
    assert sorted(r["trajectory_id"] for r in json.loads(out)) == sorted(
        t.id for t in trajectories)  # fmt: skip

    # and `streamrl report`'s reads, through the operator client
    ops = ops_client(cfg)
    try:
        data = await collect(ops, run_names, None)
    finally:
        ops.close()
    assert data.reward["arith"][0] == [r for t in trajectories for r in t.rewards]


def test_ops_commands_fail_clearly_with_a_wrong_admin_password(
    admin: tuple[Config, Credentials]
) -> None:
    cfg, creds = admin
    assert ops_url(cfg) == role_url(cfg.run.redis_url, creds)
    rc, out, err = _streamrl(cfg, "dlq", "list", STREAMRL_PASSWORD_ADMIN="not-the-password")
    assert rc == 2, out + err
    assert "invalid username-password pair" in err
    assert "not-the-password" not in out + err


def test_without_the_admin_password_the_url_is_used_as_given(
    admin: tuple[Config, Credentials], monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg, _ = admin
    monkeypatch.delenv("STREAMRL_PASSWORD_ADMIN")
    assert ops_url(cfg) == cfg.run.redis_url


# ---------------------------------------------------------------------- what the admin may not do
@pytest.fixture
def admin_client(redis_url: str, admin: tuple[Config, Credentials]) -> Iterator[RedisClient]:
    c = RedisClient(role_url(redis_url, admin[1]))
    yield c
    c.close()


async def _denied(call: Any) -> None:
    with pytest.raises(redis.ResponseError, match=r"(?i)no permissions"):
        await call()


@pytest.mark.parametrize(
    "command", [("FLUSHALL",), ("CONFIG", "GET", "*"), ("KEYS", "*"), ("ACL", "LIST")],
    ids=lambda c: " ".join(c),
)
async def test_admin_is_refused_administrative_commands(
    admin_client: RedisClient, command: tuple[str, ...]
) -> None:
    await _denied(lambda: admin_client.execute(*command))


@pytest.mark.parametrize(
    "command",
    [
        ("FLUSHDB",),
        ("CONFIG", "SET", "appendonly", "no"),
        ("SCAN", "0"),
        ("ACL", "SETUSER", "intruder", "on", ">x", "+@all", "~*"),
        ("ACL", "DELUSER", "default"),
        ("DEBUG", "SLEEP", "0"),
        ("SHUTDOWN", "NOSAVE"),
        ("MODULE", "LIST"),
        ("MONITOR",),
        ("PUBLISH", "channel", "x"),
        ("SUBSCRIBE", "channel"),
        ("SCRIPT", "FLUSH"),
        ("CLIENT", "KILL", "TYPE", "normal"),
        ("SWAPDB", "0", "1"),
        # its own run: it may not take, acknowledge, trim or delete work, nor touch the flags
        ("XREADGROUP", "GROUP", "learner", "c", "STREAMS", "{trajectories}", ">"),
        ("XACK", "{trajectories}", "learner", "0-1"),
        ("XGROUP", "DESTROY", "{trajectories}", "learner"),
        ("XTRIM", "{trajectories}", "MAXLEN", "0"),
        ("DEL", "{trajectories}"),
        ("XDEL", "{trajectories}", "0-1"),
        ("XADD", "{weights}", "*", "d", "forged"),
        ("SET", "{stop}", "1"),
        ("INCRBY", "{admitted}", "1"),
        ("INCRBY", "{trained}", "1"),
    ],
    ids=lambda c: " ".join(c[:2]),
)
async def test_admin_cannot_run_what_no_ops_command_sends(
    client: RedisClient, run_names: N.Names, admin: tuple[Config, Credentials],
    command: tuple[str, ...],
) -> None:
    keys = {
        "{trajectories}": run_names.layouts()[-1].stream(N.TRAJECTORIES),
        "{weights}": run_names.stream(N.WEIGHTS),
        "{stop}": run_names.stop,
        "{admitted}": run_names.admitted,
        "{trained}": run_names.counter("trained:arith"),
    }
    command = tuple(keys.get(a, a) for a in command)
    # Redis's own check, without running it (a wrong rule must not flush the test Redis)
    reply = client.sync.execute_command("ACL", "DRYRUN", admin[1].user, *command)
    assert "no permissions" in (reply.decode() if isinstance(reply, bytes) else str(reply))


async def test_admin_cannot_touch_another_run(
    client: RedisClient, run_names: N.Names, admin_client: RedisClient
) -> None:
    # Given another run whose name starts with this one's, with a dead letter and a blob
    other = N.Names(run_names.run + "x", shards=run_names.shards)
    layout = other.layouts()[0]
    fields = _letter(N.TASKS, b"theirs", "theirs")
    dead_id: Any = await client.call(client.sync.xadd, layout.stream(N.DEAD), fields)
    await Producer(client, layout, LIMITS).publish(N.TRAJECTORIES, [b"t" * 100])
    rows: Any = await client.call(client.sync.xrange, layout.stream(N.TRAJECTORIES))
    [(_, f)] = rows
    blob = f[b"d"].removeprefix(REF_PREFIX).decode()
    assert blob.startswith(layout.stream(N.TRAJECTORIES) + ":blob:")
    a = admin_client
    # When the admin of this run reads, lists, requeues or deletes there: refused every time
    await _denied(lambda: a.execute("XRANGE", layout.stream(N.DEAD), "-", "+"))
    await _denied(lambda: a.execute("XLEN", layout.stream(N.TASKS)))
    await _denied(lambda: a.execute("XINFO", "GROUPS", layout.stream(N.TRAJECTORIES)))
    await _denied(lambda: a.execute("XREVRANGE", other.stream(N.WEIGHTS), "+", "-"))
    await _denied(lambda: a.execute("XDEL", layout.stream(N.DEAD), dead_id))
    await _denied(lambda: a.execute("XADD", layout.stream(N.TASKS), "*", "d", b"x"))
    await _denied(lambda: a.execute("GET", blob))
    await _denied(lambda: requeue_dead_letter(
        a, layout, N.TASKS, dead_id.decode(), b"x", PayloadLimits()))  # fmt: skip
    # Then their letter is still there, and nothing was added to their tasks
    assert await client.call(client.sync.xlen, layout.stream(N.DEAD)) == 1
    assert await client.call(client.sync.exists, layout.stream(N.TASKS)) == 0


def test_acl_apply_creates_the_admin_only_where_its_password_is_set(
    redis_url: str, names: N.Names
) -> None:
    # Given every actor role's password, but not the admin's
    env = {f"STREAMRL_PASSWORD_{role.upper()}": secrets.token_hex(8) for role in ROLES}
    del env["STREAMRL_PASSWORD_ADMIN"]
    apply = [sys.executable, "-m", "streamrl", "acl", "apply", "--config", "configs/tiny.toml",
             "--set", f"run.name={names.run}", "--set", f"run.redis_url={redis_url}"]  # fmt: skip
    superuser = redis.Redis.from_url(redis_url)
    users = {f"streamrl-{names.run}-{role}" for role in ROLES}
    admin = f"streamrl-{names.run}-admin"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("STREAMRL_PASSWORD_")}
    try:
        # When the users are applied: the actors' are created, the admin's is not, and says so
        done = subprocess.run(apply, env={**clean, **env}, capture_output=True, text=True,
                              timeout=60)  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert "admin      not created (set $STREAMRL_PASSWORD_ADMIN" in done.stdout
        existing = {u.decode() for u in superuser.execute_command("ACL", "USERS")}
        assert users & existing == users - {admin}
        # When its password is set too, it is created
        env["STREAMRL_PASSWORD_ADMIN"] = secrets.token_hex(8)
        done = subprocess.run(apply, env={**clean, **env}, capture_output=True, text=True,
                              timeout=60)  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert admin in done.stdout
        assert admin.encode() in superuser.execute_command("ACL", "USERS")
    finally:
        superuser.execute_command("ACL", "DELUSER", *users)
        superuser.close()
