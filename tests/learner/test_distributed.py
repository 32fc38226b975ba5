"""Two processes under torchrun (gloo, CPU, DistributedDataParallel) take the same step as
one process: uneven shards, an empty shard, and checkpointing + KL reference under DDP."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from streamrl.learner.batch import build_batch
from streamrl.learner.distributed import shard_rows
from streamrl.learner.train import StepStats, TrainConfig, Trainer
from streamrl.models import load_model
from streamrl.protocol.messages import Trajectory
from streamrl.testing.messages import make_trajectory
from tests.torchrun import run_ranks

ROOT = Path(__file__).resolve().parents[2]

CASES: dict[str, tuple[dict[str, Any], int | None]] = {
    # 3 + 2 samples in micro-batches of 2: rank 0 runs two backward passes, rank 1 one real
    # and one padding pass
    "uneven": ({"micro_batch_size": 2}, None),
    # one sample for two ranks: rank 1's shard is empty, it runs one padding pass
    "empty_shard": ({"micro_batch_size": 2}, 1),
    # 3 + 2 passes of one sample, activation checkpointing, a KL reference model and
    # recomputed old logprobs, all under DDP
    "checkpointing_kl": (
        {"micro_batch_size": 1, "grad_checkpointing": True, "kl_coef": 0.1,
         "recompute_old_logprobs": True},
        None,
    ),
    # each micro-batch's rows share their group's prompt (2-3 tokens), computed once
    # (learner/prefix.py): the prefix forward and the rows' forward after it, under a KL
    # reference that shares it too
    "shared_prefix": ({"micro_batch_size": 2, "shared_prefix": 2, "kl_coef": 0.1}, None),
}  # fmt: skip
"""Case name -> (TrainConfig fields besides ``lr``, the batch's first N rows or all)."""


def fixed_groups() -> list[Trajectory]:
    """Two groups, 5 samples in all (an uneven split: 3 + 2), completions of 1 to 6 tokens."""
    return [
        make_trajectory([1, 2, 3], [[5, 6, 7, 8, 9, 10], [11], [12, 13]],
                        [[-3.0] * 6, [-2.0], [-4.0, -1.0]], [1.0, 0.0, 0.5], temperature=0.7),
        make_trajectory([4, 5], [[20, 21, 22], [23, 24, 25, 26]], [[-2.5] * 3, [-3.5] * 4],
                        [0.0, 1.0], temperature=0.7),
    ]  # fmt: skip


def run_case(name: str, model: Any, groups: list[Trajectory]) -> tuple[Trainer, StepStats]:
    """One step of case ``name`` on ``groups`` (in one process or on every rank), on one
    thread: the thread count changes the float summation order of the matmuls, and AdamW's
    first step (about ``lr * sign(grad)``) magnifies that on near-zero gradients."""
    fields, rows = CASES[name]
    trainer = Trainer(model, TrainConfig(lr=1e-3, num_threads=1, **fields))
    if rows is None:
        return trainer, trainer.step(groups)
    batch = build_batch(groups, pad_id=trainer.pad_id).rows(slice(0, rows))
    return trainer, trainer.step_batch(batch)


def test_shards_cover_every_row_once() -> None:
    assert shard_rows(5) == slice(0, 5)  # one process: everything
    assert shard_rows(5, of_rank=0) == slice(0, 5)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every case, run once by two gloo processes launched by torchrun; each rank saves
    ``<case>-rank<r>.pt``."""
    out = tmp_path_factory.mktemp("ddp")
    run_ranks([str(ROOT / "tests/learner/ddp_worker.py"), str(out)], deadline_s=180)
    return out


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.usefixtures("restore_threads")
def test_two_process_step_equals_one_process_step(
    case: str, two_ranks: Path, tiny_dir: Path
) -> None:
    # Given the step of one process on the batch
    single, stats = run_case(case, load_model(tiny_dir), fixed_groups())
    # When two gloo processes launched by torchrun take it under DDP, each on its shard
    got = [torch.load(two_ranks / f"{case}-rank{r}.pt", weights_only=True) for r in (0, 1)]
    # Then loss, gradient norm and the updated weights agree within float tolerance
    assert got[0]["tokens"] == stats.tokens == (16 if CASES[case][1] is None else 6)
    assert got[0]["loss"] == pytest.approx(stats.loss, rel=1e-5, abs=1e-7)
    assert got[0]["grad_norm"] == pytest.approx(stats.grad_norm, rel=1e-5)
    assert got[0]["kl_ref"] == pytest.approx(stats.kl_ref, rel=1e-5, abs=1e-9)
    want = single.model.state_dict()
    assert got[0]["state"].keys() == want.keys()  # the unwrapped model's (HF) names
    for name, tensor in got[0]["state"].items():
        torch.testing.assert_close(tensor, want[name], rtol=1e-5, atol=1e-6)
    # and both replicas hold the same weights after the step
    for name, tensor in got[1]["state"].items():
        assert torch.equal(tensor, got[0]["state"][name]), name
    # and the step moved the weights (the comparison is not between two untouched models)
    base = load_model(tiny_dir).state_dict()
    assert not torch.equal(base["model.layers.0.mlp.up_proj.weight"],
                           want["model.layers.0.mlp.up_proj.weight"])  # fmt: skip
