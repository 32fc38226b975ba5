"""Fuzz: 10,000 generated bad inputs pushed into every input stream while valid work flows.

Each lands in the dead-letter stream once, with a reason that names its problem; no actor
process exits (the same pids from start to end); the valid work completes as usual.
"""

from __future__ import annotations

import os
import random
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
import trio

from streamrl.actors.monitor import Monitor
from streamrl.config.schema import load_config
from streamrl.protocol import names as N
from streamrl.queues.client import RedisClient
from streamrl.runtime.context import ActorContext
from streamrl.testing.wait import wait_until
from tests.chaos.badinputs import INPUT_TYPES, BadInput, generate
from tests.chaos.harness import (
    REPO,
    LedgerView,
    Recorder,
    Scenario,
    check_run,
    inspect_run,
    open_pipeline,
    progress,
    wait_finished,
)

pytestmark = pytest.mark.serial  # alone, after the parallel run (pyproject's markers)

SEED = int(os.environ.get("STREAMRL_FUZZ_SEED", "7"))
PER_STREAM = 2000
MAX_BYTES = 200_000  # queues.max_message_bytes of the run: room for 100,000 nested arrays
ROUNDS = 10


async def _push(client: RedisClient, names: N.Names, batch: list[BadInput]) -> list[str]:
    def run() -> list[str]:
        pipe = client.sync.pipeline(transaction=False)
        for bad in batch:
            pipe.xadd(names.stream(bad.stream), bad.fields)
        return [i.decode() for i in pipe.execute()]

    return await client.call(run)


@pytest.mark.system
async def test_fuzzed_inputs_are_dead_lettered_and_nothing_stops(
    redis_url: str, tmp_path: Path
) -> None:
    # Given 2,000 bad inputs per input stream (tasks, rollouts, executed, trajectories and
    # evals, which the monitor of `streamrl up` consumes: here it runs in the test process)
    rng = random.Random(SEED)
    bad = {s: generate(s, PER_STREAM, rng, max_bytes=MAX_BYTES) for s in INPUT_TYPES}
    scenario = Scenario(
        redis_url,
        f"fuzz{uuid.uuid4().hex[:8]}",
        tmp_path / "run",
        items=200,
        overrides=[f"queues.max_message_bytes={MAX_BYTES}", "queues.claim_check_bytes=100000"],
    )
    config = load_config(REPO / "configs" / "tiny.toml", scenario.settings())
    client = RedisClient(redis_url)
    recorder = Recorder(client, scenario.names)
    monitor = Monitor(ActorContext(config, client, scenario.names), scenario.work_dir, 2)
    pushed: dict[tuple[str, str], BadInput] = {}
    started = time.monotonic()
    try:
        async with open_pipeline(scenario) as pipeline:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(recorder.serve)
                await nursery.start(monitor.serve)
                with trio.fail_after(300):
                    # When they are pushed in rounds, interleaved, while valid groups flow
                    await wait_until(
                        lambda: LedgerView.read(scenario.weights_root).episode_ids,
                        timeout=300,
                        interval=0.2,
                    )
                    for r in range(ROUNDS):
                        batch = [
                            b
                            for i in range(PER_STREAM // ROUNDS)
                            for s in INPUT_TYPES
                            for b in [bad[s][r * (PER_STREAM // ROUNDS) + i]]
                        ]
                        ids = await _push(client, scenario.names, batch)
                        keys = [(b.stream, i) for b, i in zip(batch, ids, strict=True)]
                        recorder.ignore.update(keys)
                        pushed.update(zip(keys, batch, strict=True))
                        await trio.sleep(1.0)
                    print(f"pushed {len(pushed)} at {time.monotonic() - started:.0f}s")
                    await wait_finished(client, scenario, timeout_s=240)
                    dead_key = scenario.names.stream(N.DEAD)

                    async def all_dead() -> bool:
                        return await client.call(client.sync.xlen, dead_key) >= len(pushed)

                    await wait_until(all_dead, timeout=300, interval=0.5)
                    print(await progress(client, scenario))
                nursery.cancel_scope.cancel()
            await pipeline.stop()
        report = await inspect_run(client, scenario, recorder)
    finally:
        client.close()
    print(f"{time.monotonic() - started:.0f}s, {len(report.metrics)} learner steps")

    # Then no actor process exited: one pid each from start to end (the monitor task, in
    # this process, would have failed the nursery)
    assert {a.name: a.pids for a in pipeline.actors if len(a.pids) != 1} == {}
    # every bad input is in the dead-letter stream once, with a reason naming its problem
    assert len(pushed) == len(INPUT_TYPES) * PER_STREAM >= 10_000
    letters = [(pushed.get((d.stream, d.entry_id)), d) for d in report.dead]
    wrong = [(b.kind, d.error[:200]) for b, d in letters if b and not b.reason_ok(d.error)]
    assert wrong == [], f"{len(wrong)} reasons do not name the problem, e.g. {wrong[:5]}"
    kinds = Counter(pushed[k].kind for k in report.dead_keys if k in pushed)
    print("dead letters by kind:", dict(kinds))
    # and the valid work completed: every admitted group trained once, nothing pending
    check_run(scenario, pipeline, report, planted=list(pushed))
