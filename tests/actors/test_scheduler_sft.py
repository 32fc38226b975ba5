"""While the learner trains on a data set (``learner.mode = "sft"``) the scheduler admits no
training group (no generator decodes for nothing, no group waits to go stale) and still
publishes the held-out rounds that evaluate the run."""

from __future__ import annotations

import json
from pathlib import Path

import trio

from streamrl.actors.scheduler import Scheduler
from streamrl.config.schema import load_config
from streamrl.protocol import names as N
from streamrl.protocol.messages import Task
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import decode
from streamrl.runtime.context import ActorContext
from streamrl.testing.wait import wait_until


async def test_an_sft_run_admits_no_training_group_and_still_evaluates(
    client: RedisClient, names: N.Names, redis_url: str, tmp_path: Path
) -> None:
    # Given a run whose learner trains on a data set
    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "2+2?"},
                                             {"role": "assistant", "content": "4"}]}) + "\n")
    config = load_config(None, [
        f"run.name={names.run}", f"run.redis_url={redis_url}", f"run.work_dir={tmp_path}",
        "learner.mode=sft", f"learner.sft.data={data}", "scheduler.eval_items=2",
        "queues.block_ms=100",
    ])  # fmt: skip
    scheduler = Scheduler(ActorContext(config, client, names))
    # When its scheduler has checked admission
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.serve)
        await wait_until(lambda: scheduler.blocked == "sft", 30,
                         what="the scheduler was not held by the sft bound")
        nursery.cancel_scope.cancel()
    # Then it published the first held-out round and no training task
    rows = await client.call(client.sync.xrange, names.stream(N.TASKS))
    tasks = [decode(f[b"d"], Task) for _, f in rows]
    assert tasks and {t.split for t in tasks} == {"eval"}, [t.split for t in tasks]
    assert int(await client.call(client.sync.get, names.admitted) or 0) == 0
