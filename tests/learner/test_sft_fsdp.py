"""SFT under FSDP2 on two gloo ranks under torchrun takes the step of one process: loss,
gradient norm, trained tokens and the gathered updated weights agree within 1e-5, with
micro-batches that split the examples unevenly over the ranks and with packed micro-batches."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import pytest
import torch

from streamrl.learner.sft_data import Example, as_trajectory
from streamrl.learner.train import StepStats, TrainConfig, Trainer
from streamrl.models import load_model
from streamrl.protocol.messages import Trajectory
from tests.torchrun import run_ranks

pytestmark = pytest.mark.system  # it starts torchrun ranks
ROOT = Path(__file__).resolve().parents[2]

CASES: dict[str, dict[str, Any]] = {
    # 5 examples: 3 on rank 0 (two passes), 2 on rank 1 (one real pass, one padding pass)
    "micro_batches": {"micro_batch_size": 2},
    # several examples per row, without attending across them
    "packed": {"max_tokens_per_micro_batch": 14},
    # per-sequence mean: the normaliser is the step's sequences, not its tokens
    "seq_mean": {"micro_batch_size": 1, "aggregation": "seq-mean-token-mean"},
}
"""Case name -> TrainConfig fields besides ``lr``."""


def examples() -> list[Trajectory]:
    """Five examples, prompts of 1-4 tokens, completions of 2-7 with masked tool results."""
    rows = [([1, 2, 3], [5, 6, 7, 8], [1, 1, 0, 1]), ([4, 5], [9, 10], [1, 1]),
            ([1, 2, 3, 4], [11, 12, 13, 14, 15, 16, 17], [1, 1, 0, 0, 0, 1, 1]),
            ([6], [18, 19, 20], [0, 1, 1]), ([7, 8], [21, 22, 23, 24, 25], [1, 0, 1, 1, 1])]
    return [as_trajectory(Example(f"ex{i}", p, t, m), f"sft-fsdp-{i}", 0)
            for i, (p, t, m) in enumerate(rows)]  # fmt: skip


def run_case(name: str, model: Any, parallelism: Literal["ddp", "fsdp"]
             ) -> tuple[Trainer, StepStats]:  # fmt: skip
    """One SFT step of case ``name`` (in one process, or on every rank), on one thread."""
    trainer = Trainer(model, TrainConfig(lr=1e-3, num_threads=1, parallelism=parallelism,
                                         **CASES[name]))  # fmt: skip
    return trainer, trainer.step(examples(), mode="sft")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every case, run once by two gloo processes under FSDP2 (sft_fsdp_worker.py)."""
    out = tmp_path_factory.mktemp("sft-fsdp")
    run_ranks([str(ROOT / "tests/learner/sft_fsdp_worker.py"), str(out)], deadline_s=180)
    return out


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.usefixtures("restore_threads")
def test_sft_step_on_two_fsdp_ranks_equals_one_process(
    case: str, two_ranks: Path, tiny_dir: Path
) -> None:
    # Given the SFT step of one process on five examples
    single, stats = run_case(case, load_model(tiny_dir), "ddp")
    # When two gloo processes take it with the model sharded by FSDP2
    got = torch.load(two_ranks / f"sft-{case}.pt", weights_only=True)
    # Then the trained tokens, loss, gradient norm and updated weights agree within 1e-5
    assert got["tokens"] == stats.tokens == 15
    assert got["loss"] == pytest.approx(stats.loss, rel=1e-5, abs=1e-7)
    assert got["grad_norm"] == pytest.approx(stats.grad_norm, rel=1e-5)
    want = single.model.state_dict()
    assert got["state"].keys() == want.keys()
    for name, tensor in got["state"].items():
        torch.testing.assert_close(tensor, want[name], rtol=1e-5, atol=1e-6, msg=name)
    # and the step moved the weights (not two untouched models compared)
    name = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(load_model(tiny_dir).state_dict()[name], want[name])
