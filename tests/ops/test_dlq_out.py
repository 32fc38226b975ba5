"""``streamrl dlq show ID --out FILE``: the whole payload of a dead letter, however large,
through the real CLI as the run's admin role; a letter holding a claim-check reference is
written with its blob resolved. Without ``--out`` ``show`` prints a summary (a 10 MB
undecodable payload: its first 256 bytes), which is no way to get the rest."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

import streamrl.domains.arith.domain  # noqa: F401  (registers the arith domain)
from streamrl.actors.verifier import serve
from streamrl.cli.dlq import list_dead
from streamrl.config.schema import Config
from streamrl.protocol import names as N
from streamrl.protocol.messages import now
from streamrl.queues.client import RedisClient, RedisURL
from streamrl.queues.codec import DeadLetter, encode
from streamrl.queues.payloads import REF_PREFIX
from streamrl.queues.streams import Producer
from streamrl.runtime.auth import apply_role_users, credentials_for_up
from streamrl.runtime.context import ActorContext
from streamrl.testing.wait import wait_until
from tests.ops.helpers import config as ops_config

TEN_MB = 10 * 1024 * 1024


@pytest.fixture
def admin_env(
    client: RedisClient, names: N.Names, tmp_path: Path
) -> Iterator[tuple[Config, dict[str, str]]]:
    """The run's users as `streamrl up` creates them, and the environment of an operator
    command as the run's admin role (URL without credentials, the admin's password)."""
    password = secrets.token_hex(16)
    bare = RedisURL(client.url.url).without_credentials().url
    cfg = ops_config(tmp_path, bare, names.run, "auth.enabled=true")
    credentials = credentials_for_up(cfg, {"STREAMRL_PASSWORD_ADMIN": password})
    trio.run(apply_role_users, cfg, client.url.url, credentials)
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMRL_")}
    env.update(STREAMRL_REDIS_URL=bare, STREAMRL_PASSWORD_ADMIN=password)
    yield cfg, env
    client.sync.execute_command("ACL", "DELUSER", *(c.user for c in credentials.values()))


def _dlq(cfg: Config, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[bytes]:
    argv = [sys.executable, "-m", "streamrl", "dlq", *args,
            "--set", f"run.name={cfg.run.name}", "--set", "auth.enabled=true"]  # fmt: skip
    return subprocess.run(argv, env=env, capture_output=True, timeout=120)


def test_show_out_writes_a_10_mb_letter_whole(
    admin_env: tuple[Config, dict[str, str]], client: RedisClient, names: N.Names, tmp_path: Path
) -> None:
    cfg, env = admin_env
    # Given a real 10 MB dead letter: an undecodable payload (claim-checked on its stream)
    # that the real verifier dead-letters
    payload = b"\xc1" + secrets.token_bytes(TEN_MB - 1)  # 0xc1: never valid MessagePack
    await_dead = ActorContext(ops_config(tmp_path, client.url.url, names.run), client, names)
    trio.run(_publish_and_serve_until_dead, await_dead, client, names, payload)
    [dead] = trio.run(list_dead, client, names)

    # When the operator shows it without --out, only a summary comes back
    plain = _dlq(cfg, env, "show", dead.dead_id)
    assert plain.returncode == 0, plain.stderr.decode()[-2000:]
    assert len(plain.stdout) < 4096
    [shown] = json.loads(plain.stdout)
    assert shown["payload_bytes"] == TEN_MB

    # When it is shown with --out FILE
    out = tmp_path / "letter.bin"
    done = _dlq(cfg, env, "show", dead.dead_id, "--out", str(out))

    # Then FILE holds the whole payload, stdout the same summary, stderr what was written
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert out.read_bytes() == payload
    assert json.loads(done.stdout) == [{**shown, "age_s": json.loads(done.stdout)[0]["age_s"]}]
    assert f"wrote {TEN_MB} bytes" in done.stderr.decode()


async def _publish_and_serve_until_dead(
    ctx: ActorContext, client: RedisClient, names: N.Names, payload: bytes
) -> None:
    await Producer(client, names).publish(N.EXECUTED, [payload])
    assert (await client.call(client.sync.keys, names.stream(N.EXECUTED) + ":blob:*"))
    async with trio.open_nursery() as nursery:
        await nursery.start(serve, ctx)
        await wait_until(lambda: list_dead(client, names), timeout=60, interval=0.1)
        nursery.cancel_scope.cancel()


def test_show_out_resolves_a_claim_check_reference(
    admin_env: tuple[Config, dict[str, str]], client: RedisClient, names: N.Names, tmp_path: Path
) -> None:
    cfg, env = admin_env
    # Given a dead letter whose payload is a claim-check reference to a blob of its stream
    blob_key = names.stream(N.EXECUTED) + ":blob:" + secrets.token_hex(8)
    blob = secrets.token_bytes(2 * 1024 * 1024)
    client.sync.set(blob_key, blob)
    letter = DeadLetter(stream=N.EXECUTED, group="verifier", entry_id="1-0", error="boom",
                        deliveries=5, payload=REF_PREFIX + blob_key.encode(), at=now())
    dead_id = client.sync.xadd(names.stream(N.DEAD), {"d": encode(letter)}).decode()

    # When it is shown with --out, as the admin role
    out = tmp_path / "letter.bin"
    done = _dlq(cfg, env, "show", dead_id, "--out", str(out))

    # Then the file holds the blob, not the reference
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert out.read_bytes() == blob

    # and a letter whose blob is gone is an error that names the blob, no file written
    client.sync.delete(blob_key)
    gone = tmp_path / "gone.bin"
    missing = _dlq(cfg, env, "show", dead_id, "--out", str(gone))
    assert missing.returncode == 1 and blob_key in missing.stderr.decode()
    assert not gone.exists()


def test_show_out_takes_exactly_one_letter(
    admin_env: tuple[Config, dict[str, str]], client: RedisClient, names: N.Names, tmp_path: Path
) -> None:
    cfg, env = admin_env
    for _ in range(2):
        letter = DeadLetter(stream=N.EXECUTED, group="verifier", entry_id="1-0", error="boom",
                            deliveries=5, payload=b"\xc1", at=now())
        client.sync.xadd(names.stream(N.DEAD), {"d": encode(letter)})
    done = _dlq(cfg, env, "show", "--all", "--out", str(tmp_path / "x.bin"))
    assert done.returncode == 2 and b"exactly one" in done.stderr
    assert not (tmp_path / "x.bin").exists()
