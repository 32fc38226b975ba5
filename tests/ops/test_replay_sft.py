"""``streamrl replay export --sft``: rejection sampling from the run's own groups. The samples
of training groups whose own reward reaches the threshold become token rows of an SFT data
set (held-out groups and lower rewards left out), which the learner's loader
takes as they are."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import streamrl.domains.arith.domain  # noqa: F401  (registers the arith domain)
from streamrl.actors.verifier import Verifier
from streamrl.cli.main import _parser
from streamrl.cli.replay import run_replay
from streamrl.learner.sft_data import load_sft_data
from streamrl.models import load_tokenizer, resolve_model
from streamrl.protocol import names as N
from streamrl.protocol.messages import Executed, Trajectory
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import encode
from streamrl.queues.streams import Producer
from tests.ops.helpers import config, executed


async def _verified(group: Executed) -> Trajectory:
    out, *_ = await Verifier().handle(group)  # type: ignore[arg-type]  # output, counters
    return out.message  # type: ignore[no-any-return]


async def test_export_sft_keeps_the_training_samples_that_reached_the_reward(
    client: RedisClient, names: N.Names, redis_url: str, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Given a training group with one right and two wrong answers, one with two right, and a
    # held-out group with a right answer
    a = await _verified(executed("6", ["6", "7", "oops"]))
    b = await _verified(executed("9", ["9", "9"], policy_version=1))
    c = await _verified(executed("4", ["5", "4"], split="eval"))
    assert [t.rewards for t in (a, b, c)] == [[1.0, 0.0, 0.0], [1.0, 1.0], [0.0, 1.0]]
    await Producer(client, names).publish(N.TRAJECTORIES, [encode(a), encode(b)])
    await Producer(client, names).publish(N.EVALS, [encode(c)])
    out = tmp_path / "sft.jsonl"
    cfg = config(tmp_path, redis_url, names.run)

    async def export(*extra: str) -> int:
        args = _parser().parse_args(["replay", "export", "--source", "live", *extra])
        return await run_replay(client, names, cfg, args)

    # When the run's groups are exported as an SFT set of the samples with reward >= 1
    assert await export("--sft", str(out), "--sft-min-reward", "1") == 0

    # Then it holds the three right training samples, as the policy sampled them
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["id"], r["reward"]) for r in rows] == [
        (f"{a.id}-0", 1.0), (f"{b.id}-0", 1.0), (f"{b.id}-1", 1.0)]
    assert rows[0]["prompt_ids"] == [1, 2, 3]
    assert [r["completion_ids"] for r in rows] == [[10, 11, 12], [10, 11, 12], [11, 11, 12]]
    assert all(r["mask"] == [1, 1, 1] and r["domain"] == "arith" for r in rows)
    assert "exported 3 SFT rows" in capsys.readouterr().out
    # and the learner's loader takes them as token rows, ids and tokens unchanged
    tokenizer = load_tokenizer(resolve_model("tiny"))
    examples = load_sft_data(str(out), tokenizer, vocab=49152).examples
    assert [(e.id, e.tokens) for e in examples] == [
        (r["id"], r["completion_ids"]) for r in rows]
    # and a threshold is required
    assert await export("--sft", str(out)) == 2
