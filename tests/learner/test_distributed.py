"""Two processes under torchrun (gloo, CPU) take the same step as one process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from learner.batch import make_trajectory
from learner.distributed import shard_rows
from learner.model import load_model
from learner.train import TrainConfig, Trainer
from queues.messages import Trajectory

ROOT = Path(__file__).resolve().parents[2]


def fixed_groups() -> list[Trajectory]:
    """Two groups, 5 samples in all (an uneven split: 3 + 2), completions of 1 to 6 tokens."""
    return [
        make_trajectory([1, 2, 3], [[5, 6, 7, 8, 9, 10], [11], [12, 13]],
                        [[-3.0] * 6, [-2.0], [-4.0, -1.0]], [1.0, 0.0, 0.5], temperature=0.7),
        make_trajectory([4, 5], [[20, 21, 22], [23, 24, 25, 26]], [[-2.5] * 3, [-3.5] * 4],
                        [0.0, 1.0], temperature=0.7),
    ]  # fmt: skip


def test_shards_cover_every_row_once() -> None:
    assert shard_rows(5) == slice(0, 5)  # one process: everything


def test_two_process_step_equals_one_process_step(tiny_dir: Path, tmp_path: Path) -> None:
    # Given the step of one process on the batch
    single = Trainer(load_model(tiny_dir), TrainConfig(lr=1e-3, micro_batch_size=2))
    stats = single.step(fixed_groups())
    # When two gloo processes launched by torchrun take it, each on its shard
    out = tmp_path / "rank0.pt"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(ROOT / "tests/learner/ddp_worker.py"), str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(out, weights_only=True)
    # Then loss, gradient norm and the updated weights agree within float tolerance
    assert got["tokens"] == stats.tokens == 16
    assert got["loss"] == pytest.approx(stats.loss, rel=1e-5, abs=1e-7)
    assert got["grad_norm"] == pytest.approx(stats.grad_norm, rel=1e-5)
    want = single.model.state_dict()
    for name, tensor in got["state"].items():
        torch.testing.assert_close(tensor, want[name], rtol=1e-5, atol=1e-6)
    # and the step moved the weights (the comparison is not between two untouched models)
    base = load_model(tiny_dir).state_dict()
    assert not torch.equal(base["model.layers.0.mlp.up_proj.weight"],
                           want["model.layers.0.mlp.up_proj.weight"])  # fmt: skip
