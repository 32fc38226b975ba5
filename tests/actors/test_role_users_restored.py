"""An external Redis without an ACL file keeps the run's role users in memory only: its
restart loses them. ``streamrl up``'s supervision (runtime.auth.serve_role_users) creates them
again, and an actor whose logins were refused meanwhile goes on. A real Redis, restarted on
its own port with its AOF, and no ``aclfile``."""

from __future__ import annotations

import functools
import secrets
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import redis
import trio

from streamrl.config.schema import load_config
from streamrl.net import free_port
from streamrl.protocol import names as N
from streamrl.protocol.roles import ROLES
from streamrl.queues.acl import missing_users, role_url
from streamrl.queues.client import Reconnect, RedisClient
from streamrl.queues.server import find_server_binary
from streamrl.runtime.auth import apply_role_users, credentials_for_up, serve_role_users


class ExternalRedis:
    """A Redis as an operator runs one without an ACL file: a password, AOF, a fixed port."""

    def __init__(self, data_dir: Path) -> None:
        self.binary = shutil.which("redis-server") or find_server_binary()
        self.data_dir, self.port, self.password = data_dir, free_port(), secrets.token_hex(8)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def admin_url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
             "--requirepass", self.password, "--appendonly", "yes", "--save", "",
             "--dir", str(self.data_dir)],
            stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        admin = redis.Redis.from_url(self.admin_url)
        deadline = time.monotonic() + 20
        while True:
            try:
                if admin.ping():
                    break
            except (redis.ConnectionError, redis.BusyLoadingError):
                assert time.monotonic() < deadline, "redis did not start"
                time.sleep(0.05)
        admin.close()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()  # a clean shutdown: the AOF is complete
            self.process.wait(timeout=20)


@pytest.fixture
def external_redis(tmp_path: Path) -> ExternalRedis:
    server = ExternalRedis(tmp_path / "redis")
    server.start()
    yield server  # type: ignore[misc]
    server.stop()


async def test_role_users_lost_in_a_restart_are_created_again_and_the_actor_goes_on(
    external_redis: ExternalRedis, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a run's role users on a Redis without an ACL file, a generator connected as its
    # user, and up's supervision of the users running
    bare = f"redis://127.0.0.1:{external_redis.port}/0"
    run = f"t{secrets.token_hex(5)}"
    cfg = load_config("configs/tiny.toml",
                      [f"run.name={run}", f"run.redis_url={bare}", f"run.work_dir={tmp_path}"])
    credentials = credentials_for_up(cfg, {})
    await apply_role_users(cfg, external_redis.admin_url, credentials)
    names = N.Names(run)
    generator = RedisClient(role_url(bare, credentials["generator"]),
                            reconnect=Reconnect(timeout_s=30.0))  # fmt: skip
    admin = RedisClient(external_redis.admin_url)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(functools.partial(
                serve_role_users, cfg, external_redis.admin_url, credentials, interval_s=0.5))
            await generator.call(generator.sync.xadd, names.stream(N.ROLLOUTS), {"d": b"1"})

            # When Redis restarts (its data kept, its users not)
            external_redis.stop()
            external_redis.start()

            # Then the generator's next call gets in once the users are back, and goes on
            with trio.fail_after(20):
                await generator.call(generator.sync.xadd, names.stream(N.ROLLOUTS), {"d": b"2"})
            assert await admin.call(admin.sync.xlen, names.stream(N.ROLLOUTS)) == 2
            assert await missing_users(admin, [c.user for c in credentials.values()]) == []
            nursery.cancel_scope.cancel()
        assert f"Redis had lost {len(ROLES)} of the run's ACL users" in capsys.readouterr().out
    finally:
        generator.close()
        admin.close()
