"""SIGKILL chaos on a pipeline split into 3 shards on the real 3-node Redis Cluster.

What sharding adds to the single-slot run is hand-offs that cross slots: the scheduler's
counted admission (count + record in the run's slot, then the tasks into each shard) and the
learner's step (weights and metrics in the run's slot, then the acknowledgements in each
shard). A process killed between the steps must leave nothing lost and nothing doubled:
every admitted group is published once and trained once (the ledger), no admission record
is left, nothing is pending, and the dead letters are exactly the poison planted in every
shard.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from streamrl.queues.server import ClusterProcess
from tests.chaos.harness import check_run
from tests.chaos.test_chaos import describe, run_chaos

pytestmark = pytest.mark.serial  # alone, after the parallel run (pyproject's markers)


@pytest.mark.system
async def test_sigkill_chaos_on_a_sharded_run(
    redis_cluster: ClusterProcess, tmp_path: Path
) -> None:
    # Given 100 training groups through 3 shards of a 3-node cluster, 8 actor processes
    # When a random process holding work is SIGKILLed after every 10-25 entries published
    scenario, pipeline, report, planted, chaos, elapsed = await run_chaos(
        redis_cluster.url, tmp_path / "run", items=100, min_kills=8, timeout_s=240,
        every_hops=(10, 25), patience_hops=10, shards=3,
    )  # fmt: skip
    print(describe(pipeline, report, chaos, elapsed))
    # Then nothing was lost or done twice, in any shard
    assert len(chaos.kills) >= 8
    assert {k.split("@")[-1] for k in report.pending} == {"0", "1", "2"}
    check_run(scenario, pipeline, report, planted)
