"""The parallel run's groups hold: tests that tests/conftest.py puts in one xdist group (the
Docker engine's, the Redis Cluster's, the fixed metrics ports') run on one worker.

pytest 9.2 with pytest-xdist 3.8 silently ran them on both workers (xdist's loadgroup renames
``Node._nodeid``, which pytest 9.2 no longer reads), so the Docker tests' sandboxes reaped each
other's containers. This runs a real ``pytest -n 2 --dist loadgroup`` (the README's test
command's options) over tests placed under the grouped paths, with our conftest's hook.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TEST = """
import os, time, pytest

@pytest.mark.parametrize("i", range({n}))
def test_{name}(i):
    time.sleep(0.2)
    with open({log!r}, "a") as f:
        f.write("{name} " + os.environ["PYTEST_XDIST_WORKER"] + "\\n")
"""


def test_grouped_tests_share_one_worker(tmp_path: Path) -> None:
    log = tmp_path / "workers.log"
    files = {
        "tests/sandbox/test_docker_like.py": ("docker", 6),
        "tests/compose/test_compose_like.py": ("docker", 4),
        "tests/queues/test_cluster.py": ("cluster", 4),
        "tests/ops/test_metrics.py": ("ports", 3),
        "tests/test_free.py": ("free", 8),
    }
    for path, (group, n) in files.items():
        target = tmp_path / path
        target.parent.mkdir(parents=True, exist_ok=True)
        name = f"{group}_{target.stem}"
        target.write_text(TEST.format(n=n, name=name, log=str(log)))
    # the project's hook, as the real run's tests/conftest.py registers it
    (tmp_path / "conftest.py").write_text(
        "from tests.conftest import pytest_collection_modifyitems  # noqa: F401\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup",
         "-p", "no:cacheprovider", "-p", "no:randomly", "--rootdir", str(tmp_path),
         "-c", os.devnull, str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    workers: dict[str, set[str]] = {}
    for line in log.read_text().splitlines():
        name, worker = line.split()
        workers.setdefault(name.split("_", 1)[0], set()).add(worker)
    assert sum(1 for _ in log.read_text().splitlines()) == 25
    for group in ("docker", "cluster", "ports"):
        assert len(workers[group]) == 1, (group, workers)
    # and the run was parallel: both workers ran tests
    assert set().union(*workers.values()) == {"gw0", "gw1"}, workers
