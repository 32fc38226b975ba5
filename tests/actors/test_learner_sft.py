"""The learner actor with ``learner.mode = "sft"`` against a real Redis and the tiny model:
its steps lower the loss on the data set and are published like RL versions; a restarted
learner continues with the next positions of the data set, each trained exactly once; two
torchrun ranks under FSDP2 publish the weights one process does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import trio
from safetensors.torch import load_file

from streamrl.actors.learner import open_sft_data, serve
from streamrl.config.schema import Config
from streamrl.learner.checkpoint import LEDGER_FILE
from streamrl.learner.sft_data import SFTData
from streamrl.learner.weights import version_dir
from streamrl.models import load_model, resolve_model
from streamrl.protocol import names as N
from streamrl.protocol.messages import StepMetrics, WeightsPublished
from streamrl.protocol.names import Names
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import decode
from streamrl.runtime.context import ActorContext
from tests.helpers import run_config
from tests.torchrun import learner_ranks

ANSWERS = ["four", "six", "eight", "ten", "twelve", "fourteen"]


def _data(tmp_path: Path) -> Path:
    """Six chat rows: a question and its answer, the second with a tool call and its result."""
    rows = []
    for i, answer in enumerate(ANSWERS):
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": f"What is {2 * (i + 2)} in words?"},
            {"role": "assistant", "content": f"It is {answer}."},
        ]
        if i % 2:
            messages[1:1] = [
                {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                 "function": {"name": "spell", "arguments": {"n": 2 * (i + 2)}}}]},
                {"role": "tool", "tool_call_id": "call_0", "content": answer},
            ]  # fmt: skip
        rows.append({"messages": messages, "tools": [{"type": "function", "function": {
            "name": "spell", "description": "A number in words.",
            "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}}}}]})
    path = tmp_path / "sft.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _overrides(tmp_path: Path, steps: int) -> list[str]:
    return [
        "model.spec=tiny", "learner.mode=sft", f"learner.sft.data={_data(tmp_path)}",
        "learner.sft.examples_per_step=4", f"learner.max_steps={steps}", "learner.lr=3e-3",
        "learner.micro_batch_size=2", "queues.block_ms=200",
    ]  # fmt: skip


def _config(tmp_path: Path, redis_url: str, run: str, steps: int) -> Config:
    return run_config(tmp_path, redis_url, run, *_overrides(tmp_path, steps))


def _nll(model_dir: Path, data: SFTData) -> float:
    """Mean NLL per trained token of every example under the model in ``model_dir``."""
    model = load_model(model_dir)
    total, count = 0.0, 0
    with torch.no_grad():
        for ex in data.examples:
            ids = torch.tensor([ex.prompt_ids + ex.tokens])
            logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
            for j, keep in enumerate(ex.mask):
                if keep:
                    pos = len(ex.prompt_ids) - 1 + j
                    total -= float(logp[pos, ids[0, pos + 1]])
                    count += 1
    return total / count


def _ledger(weights: Path) -> list[dict[str, Any]]:
    return [msgspec.json.decode(line) for line in (weights / LEDGER_FILE).read_text().splitlines()]


async def _versions(client: RedisClient, names: N.Names) -> list[int]:
    rows = await client.call(client.sync.xrange, names.stream(N.WEIGHTS))
    return [decode(f[b"d"], WeightsPublished).version for _, f in rows]


async def test_sft_learner_lowers_the_loss_on_its_data_and_resumes_at_the_next_examples(
    client: RedisClient, names: N.Names, redis_url: str, tmp_path: Path
) -> None:
    # Given a learner in SFT mode on six chat examples, four a step
    config = _config(tmp_path, redis_url, names.run, steps=2)
    data = open_sft_data(config)
    before = _nll(resolve_model("tiny"), data)

    # When it takes two steps and stops (no trajectory was ever published)
    with trio.fail_after(120):
        await serve(ActorContext(config, client, names))

    # Then it published versions 1 and 2 with their metrics, like RL steps
    assert await _versions(client, names) == [1, 2]
    metrics = [decode(f[b"d"], StepMetrics)
               for _, f in await client.call(client.sync.xrange, names.stream(N.METRICS))]
    assert [(m.step, m.groups, m.samples) for m in metrics] == [(1, 4, 4), (2, 4, 4)]
    assert all(m.tokens > 0 and m.loss > 0 and m.grad_norm > 0 for m in metrics)
    # and the published weights have a lower loss on the data set than the base model
    weights = tmp_path / "weights"
    after = _nll(version_dir(weights, 2), data)
    assert after < before
    # and the ledger lists positions 0-3, then 4-7 (the second epoch begins at 6)
    ledger = _ledger(weights)
    assert [r["episode_ids"] for r in ledger] == [
        [data.example_id(p) for p in range(0, 4)], [data.example_id(p) for p in range(4, 8)]]

    # When the learner restarts with one step more to take
    more = _config(tmp_path, redis_url, names.run, steps=3)
    with trio.fail_after(120):
        await serve(ActorContext(more, client, names))

    # Then it re-announces version 2 (idempotent) and trains positions 8-11 as version 3
    assert await _versions(client, names) == [1, 2, 3]
    ledger = _ledger(weights)
    assert ledger[-1]["version"] == 3
    assert ledger[-1]["episode_ids"] == [data.example_id(p) for p in range(8, 12)]
    assert _nll(version_dir(weights, 3), data) < after


@pytest.mark.system
async def test_sft_learner_on_two_fsdp_ranks_publishes_what_one_process_does(
    client: RedisClient, names: N.Names, redis_url: str, tmp_path: Path
) -> None:
    # Given the same SFT run as one process and as two torchrun ranks under FSDP2
    solo, multi = Names(names.run + "s"), Names(names.run + "f")
    with trio.fail_after(120):
        await serve(ActorContext(_config(tmp_path / "solo", redis_url, solo.run, steps=2),
                                 client, solo))  # fmt: skip
    work = tmp_path / "multi"
    await learner_ranks([f"run.name={multi.run}", f"run.redis_url={redis_url}",
                         f"run.work_dir={work}", "auth.enabled=false",
                         "learner.parallelism=fsdp", *_overrides(work, steps=2)],
                        deadline_s=180)  # fmt: skip
    # Then the ranks published versions 1 and 2, whose weights are the single process's
    assert await _versions(client, multi) == [1, 2]
    a = load_file(tmp_path / "solo" / "weights" / "v000002" / "model.safetensors")
    b = load_file(work / "weights" / "v000002" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=name)
