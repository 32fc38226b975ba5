"""Per-role credentials in the actors: config, connection, `streamrl up`'s children, the CLI."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from streamrl.cli.main import main
from streamrl.cli.up import _children
from streamrl.config.schema import Config, ConfigError, load_config
from streamrl.protocol.names import Names
from streamrl.protocol.roles import ROLES
from streamrl.queues.acl import role_url
from streamrl.queues.client import RedisClient, RedisURL
from streamrl.runtime.auth import apply_role_users, credentials_for_up, role_credentials
from streamrl.runtime.context import open_context


@pytest.fixture
def config(redis_url: str, names: Names, tmp_path: Path) -> Iterator[Config]:
    """configs/tiny.toml (auth enabled) for this test's run; its users deleted afterwards."""
    yield load_config(
        "configs/tiny.toml",
        [f"run.name={names.run}", f"run.redis_url={redis_url}", f"run.work_dir={tmp_path}"],
    )
    admin = RedisClient(redis_url)
    users = [f"streamrl-{names.run}-{role}" for role in ROLES]
    admin.sync.execute_command("ACL", "DELUSER", *users)
    admin.close()


def test_shipped_configs_use_per_role_users() -> None:
    for path in ("configs/tiny.toml", "configs/demo.toml"):
        assert load_config(path).auth.enabled, path


def _users_connected(client: RedisClient) -> set[str]:
    listing = client.sync.execute_command("CLIENT", "LIST")
    text = listing.decode() if isinstance(listing, bytes) else str(listing)
    return {field[5:] for line in text.splitlines() for field in line.split() if "user=" in field}


async def test_an_actor_connects_as_its_roles_user(
    config: Config, client: RedisClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given the run's users, and the generator's password in its environment
    credentials = credentials_for_up(config, {})
    await apply_role_users(config, config.run.redis_url, credentials)
    monkeypatch.setenv("STREAMRL_PASSWORD_GENERATOR", credentials["generator"].password)
    # When a generator process opens its context
    async with open_context(config, "generator") as ctx:
        await ctx.client.execute("PING")
        # Then it is connected as the generator's user, which may not read the config
        assert credentials["generator"].user in _users_connected(client)
        with pytest.raises(Exception, match=r"(?i)no permissions"):
            await ctx.client.execute("CONFIG", "GET", "requirepass")


async def test_a_missing_role_password_is_a_clear_error(config: Config) -> None:
    with pytest.raises(ConfigError, match=r"\$STREAMRL_PASSWORD_VERIFIER"):
        role_credentials(config, "verifier", {})
    with pytest.raises(ConfigError, match="verifier"):
        async with open_context(config, "verifier"):
            pass


def test_up_gives_each_child_only_its_own_password(config: Config) -> None:
    credentials = credentials_for_up(config, {"STREAMRL_PASSWORD_LEARNER": "from-env"})
    assert credentials["learner"].password == "from-env"  # set by the operator: kept
    bare = RedisURL(config.run.redis_url).without_credentials().url
    config = load_config(None, [f"run.redis_url={bare}", "auth.enabled=true"])
    children = _children(config, Path("configs/tiny.toml"), credentials)
    assert {c.actor for c in children} == {
        "scheduler",
        "generator",
        "executor",
        "verifier",
        "learner",
        "archiver",  # ops.archive (pyarrow is in the test extra)
    }
    for child in children:
        own = f"STREAMRL_PASSWORD_{child.actor.upper()}"
        given = {k for k in child.env if k.startswith("STREAMRL_PASSWORD_")}
        assert given == {own}
        assert child.env[own] == credentials[child.actor].password
        assert child.env["STREAMRL_REDIS_URL"] == bare  # no admin password
        passwords = {c.password for c in credentials.values()}
        assert not any(p in arg for p in passwords for arg in child.argv)


def test_acl_apply_creates_the_users_and_prints_no_secret(
    config: Config,
    names: Names,
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    passwords = {role: secrets.token_hex(8) for role in ROLES}
    for role, password in passwords.items():
        monkeypatch.setenv(f"STREAMRL_PASSWORD_{role.upper()}", password)
    monkeypatch.setenv("STREAMRL_REDIS_URL", redis_url)
    argv = ["acl", "apply", "--config", "configs/tiny.toml", "--set", f"run.name={names.run}"]
    assert main(argv) == 0
    out = capsys.readouterr()
    admin_password = redis_url.rpartition("@")[0].rpartition(":")[2]
    for secret in [*passwords.values(), admin_password]:
        assert secret not in out.out + out.err
    assert f"streamrl-{names.run}-learner" in out.out
    # the executor can now connect with its own password
    executor = redis.Redis.from_url(role_url(redis_url, role_credentials(config, "executor")))
    assert executor.ping()
    executor.close()
