"""Evaluation over time: every held-out round covers every trained domain and the eval-only
``general`` set, and the monitor's summary and ``streamrl report`` show one series per
domain over policy versions.

Real Redis streams, the real scheduler round publisher, executor (process sandbox: the cad
scripts really run), verifier, monitor and report. A scripted policy stands in for the model
(this test is about the evaluation machinery, not the model): at version 0 it answers the
trained domains' held-out items wrongly and ``general`` rightly, at version 2 the other way
round, so the series must show the trained domains improve and ``general`` drop (the
forgetting the eval set exists to reveal). One training group per trained domain goes to the
learner's stream too, so the report can tell trained from eval-only domains.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio

from streamrl.actors.executor import Executor, Sandboxes
from streamrl.actors.monitor import Monitor
from streamrl.actors.scheduler import eval_domains, eval_round_size, publish_eval_round
from streamrl.actors.verifier import Verifier
from streamrl.cli.report import charts, collect, forgetting
from streamrl.config.schema import Config, load_config
from streamrl.domains.cad.runtime import install
from streamrl.domains.finance.domain import FinanceItem, parts_of, ratio_of
from streamrl.protocol import names as N
from streamrl.protocol.messages import Executed, Rollout, Sample, Task, new_id, now
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import decode, encode
from streamrl.queues.operations import increment
from streamrl.queues.streams import Producer
from streamrl.runtime.context import ActorContext

TRAINED = ["math", "finance", "cad"]


def _config(tmp_path: Path, redis_url: str, run: str) -> Config:
    return load_config(None, [
        f"run.name={run}", f"run.redis_url={redis_url}", f"run.work_dir={tmp_path}",
        "model.spec=tiny", f"scheduler.domains={json.dumps(TRAINED)}",
        'scheduler.eval_domains=["general"]', "scheduler.eval_items=2",
    ])  # fmt: skip


def right_answer(task: Task) -> str:
    spec = task.spec
    if task.domain == "math":
        return f"Answer: {spec['answer']}"
    if task.domain == "cad":
        return f"```python\n{spec['reference']}```"
    if task.domain == "finance":
        item = msgspec.convert(spec, FinanceItem)
        parts = parts_of(item)
        total = sum(parts.values())
        return json.dumps({"parts": parts, "total": total, "ratio": ratio_of(item, parts, total)})
    return str(spec["answer"])


def scripted(task: Task, version: int) -> Rollout:
    good = (version > 0) != (task.domain == "general")  # general: right first, then wrong
    text = right_answer(task) if good else "I am not sure."
    sample = Sample(tokens=b"\x01\x00\x00\x00", logprobs=b"\x00\x00\x00\x00", text=text,
                    finish_reason="stop", weight_version=version)
    return Rollout(id=new_id(), created_at=now(), policy_version=version, task=task,
                   prompt_ids=b"\x01\x00\x00\x00", samples=[sample])


async def play_round(ctx: ActorContext, client: RedisClient, names: N.Names, round_no: int,
                     version: int, seen: int) -> tuple[list[Task], int]:
    """Open and publish a held-out round (as the scheduler does); generate (scripted),
    execute and verify every task."""
    assert await increment(client, names.eval_round) == round_no + 1
    published = await publish_eval_round(ctx, round_no, version)
    rows: Any = await client.call(client.sync.xrange, names.stream(N.TASKS))
    tasks = [decode(f[b"d"], Task) for _, f in rows[seen:]]
    assert len(tasks) == published
    executor, verifier = Executor(Sandboxes("process")), Verifier()
    out: list[bytes] = []

    async def one(task: Task) -> None:
        [executed] = await executor.handle(scripted(task, version))
        assert isinstance(executed.message, Executed)
        [verified] = await verifier.handle(executed.message)
        assert verified.stream == N.EVALS
        out.append(encode(verified.message))

    async def train_one(task: Task) -> None:
        train = msgspec.structs.replace(task, split="train", eval_round=-1)
        [executed] = await executor.handle(scripted(train, version))
        assert isinstance(executed.message, Executed)
        verified, *_ = await verifier.handle(executed.message)  # output, counters
        assert verified.stream == N.TRAJECTORIES
        await Producer(client, names).publish(N.TRAJECTORIES, [encode(verified.message)])

    async with executor.sandboxes.opened(), trio.open_nursery() as nursery:
        for task in tasks:
            nursery.start_soon(one, task)
        if round_no == 0:
            for task in {t.domain: t for t in tasks if t.domain in TRAINED}.values():
                nursery.start_soon(train_one, task)
    await Producer(client, names).publish(N.EVALS, out)
    return tasks, seen + len(tasks)


@pytest.mark.system
async def test_every_domain_has_an_eval_series_including_general(
    client: RedisClient, names: N.Names, redis_url: str, tmp_path: Path
) -> None:
    install()
    config = _config(tmp_path, redis_url, names.run)
    ctx = ActorContext(config, client, names)
    assert eval_domains(config) == [*TRAINED, "general"]
    size = eval_round_size(config)
    assert size == 2 * 4
    monitor = Monitor(ctx, tmp_path, size)

    # When two rounds are evaluated, at policy versions 0 and 2
    async with trio.open_nursery() as nursery:
        await nursery.start(monitor.serve)
        with trio.fail_after(120):
            tasks0, seen = await play_round(ctx, client, names, 0, 0, 0)
            await monitor.wait_round(0)
            tasks1, _ = await play_round(ctx, client, names, 1, 2, seen)
            await monitor.wait_round(1)
        nursery.cancel_scope.cancel()

    # Then each round held every domain's items, general included, all as eval tasks
    for tasks in (tasks0, tasks1):
        assert sorted(t.domain for t in tasks) == sorted([*TRAINED, "general"] * 2)
        assert {t.split for t in tasks} == {"eval"}
    # and the monitor's summary has one series per domain over the two versions
    summary = monitor.summary(names.run)
    series = summary.eval_by_domain
    assert sorted(series) == sorted([*TRAINED, "general"])
    for domain in TRAINED:
        assert [(p["policy_version"], p["reward"]) for p in series[domain]] == [(0, 0.0), (2, 1.0)]
    assert [(p["policy_version"], p["reward"]) for p in series["general"]] == [(0, 1.0), (2, 0.0)]
    assert summary.eval_rounds[1]["by_domain"] == {"cad": 1.0, "finance": 1.0, "general": 0.0,
                                                   "math": 1.0}
    line = monitor.progress_line()
    assert "general 0.00" in line
    assert "| reward - (no learner step yet) |" in line and "reward nan" not in line
    # and so does the report, with general marked as never trained
    data = await collect(client, names, None)
    assert {d: sorted(by) for d, by in data.evals.items()} == {
        d: [0, 2] for d in [*TRAINED, "general"]}
    assert sorted(data.reward) == sorted(TRAINED)
    table = "\n".join(forgetting(data))
    assert "| general | no (eval only) | 1.000 (v0) | 0.000 (v2) | -1.000 **forgetting** |" in table
    assert "| cad | yes | 0.000 (v0) | 1.000 (v2) | +1.000 |" in table
    assert "eval.png" in charts(data, tmp_path)
