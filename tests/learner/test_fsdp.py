"""FSDP2 on two gloo ranks under torchrun takes the step of one process (loss, gradient norm,
updated weights), also where the ranks' micro-batches would take different forwards (the
shared prefix on one rank only), holds half of the model per rank, resumes from its sharded
checkpoint in one process, and exports Hugging Face weights that give the trained model's
logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import pytest
import torch

from streamrl.learner.batch import build_batch
from streamrl.learner.fsdp import SHARDED_DIR
from streamrl.learner.lora import LoraSettings
from streamrl.learner.train import StepStats, TrainConfig, Trainer
from streamrl.learner.weights import version_dir
from streamrl.models import load_model
from streamrl.protocol.messages import Trajectory
from streamrl.testing.messages import make_trajectory
from tests.learner.test_distributed import CASES, fixed_groups
from tests.torchrun import run_ranks

ROOT = Path(__file__).resolve().parents[2]
Parallelism = Literal["ddp", "fsdp"]


def run_case(
    name: str, model: Any, groups: list[Trajectory], parallelism: Parallelism = "fsdp"
) -> tuple[Trainer, StepStats]:
    """One step of test_distributed's case ``name``, on one thread (see its ``run_case``)."""
    fields, rows = CASES[name]
    config = TrainConfig(lr=1e-3, num_threads=1, parallelism=parallelism, **fields)
    trainer = Trainer(model, config)
    if rows is None:
        return trainer, trainer.step(groups)
    batch = build_batch(groups, pad_id=trainer.pad_id).rows(slice(0, rows))
    return trainer, trainer.step_batch(batch)


LONG_PROMPT = list(range(100, 120))
"""20 tokens: above the default ``shared_prefix`` (16), so rows sharing it take the prefix."""

PATTERN_CASES: dict[str, tuple[list[Trajectory], dict[str, Any]]] = {
    # one group of 3 in micro-batches of 2: rank 0's two rows share the prompt (the prefix
    # forward, two model calls), rank 1's one row does not (the plain forward, one call)
    "one_group_of_three": (
        [make_trajectory(LONG_PROMPT, [[5, 6, 7], [8, 9], [10, 11, 12, 13]],
                         [[-3.0] * 3, [-2.0] * 2, [-1.0] * 4], [1.0, 0.0, 0.5], temperature=0.7)],
        {"micro_batch_size": 2},
    ),
    # a prompt under 16 tokens on one rank only, with a KL reference model and recomputed old
    # logprobs (their forwards take the same decision)
    "short_prompt_on_one_rank": (
        [make_trajectory(LONG_PROMPT, [[5, 6, 7], [8, 9]], [[-3.0] * 3, [-2.0] * 2], [1.0, 0.0],
                         temperature=0.7),
         make_trajectory([4, 5], [[20, 21, 22], [23, 24, 25, 26]], [[-2.5] * 3, [-3.5] * 4],
                         [0.0, 1.0], temperature=0.7)],
        {"micro_batch_size": 2, "kl_coef": 0.1, "recompute_old_logprobs": True},
    ),
    # rank 0's micro-batch has no token to train on (both its samples masked out, as an
    # overlong filter or a turn mask leaves them): a zero gradient, not an error, on one rank
    "no_token_on_one_rank": (
        [make_trajectory([1, 2, 3], [[5, 6], [7, 8], [9, 10, 11], [12]],
                         [[-1.0] * 2, [-2.0] * 2, [-3.0] * 3, [-0.5]], [1.0, 0.0, 0.0, 1.0],
                         masks=[[0, 0], [0, 0], [1, 1, 1], [1]], temperature=0.7)],
        {"micro_batch_size": 2},
    ),
}  # fmt: skip
"""Case name -> (the step's groups, TrainConfig fields besides ``lr``): batches whose ranks'
micro-batches would not all take the same forward."""


def run_pattern_case(name: str, model: Any, parallelism: Parallelism) -> tuple[Trainer, StepStats]:
    """One step of ``PATTERN_CASES[name]`` (in one process or on every rank), on one thread."""
    groups, fields = PATTERN_CASES[name]
    trainer = Trainer(model, TrainConfig(lr=1e-3, num_threads=1, parallelism=parallelism,
                                         **fields))  # fmt: skip
    return trainer, trainer.step(groups)


def test_fsdp_with_lora_is_refused() -> None:
    """The FSDP snapshot publishes whole models; LoRA's adapters and merge are not wired to it."""
    with pytest.raises(ValueError, match="lora with parallelism ddp"):
        TrainConfig(parallelism="fsdp", lora=LoraSettings())
    TrainConfig(parallelism="ddp", lora=LoraSettings())


def next_groups() -> list[Trajectory]:
    """The batch of the step after a resume: other completions and rewards."""
    return [
        make_trajectory([7, 8], [[30, 31], [32, 33, 34], [35]], [[-2.0] * 2, [-3.0] * 3, [-1.5]],
                        [0.0, 1.0, 1.0], temperature=0.7),
        make_trajectory([9], [[40, 41, 42, 43], [44]], [[-2.2] * 4, [-0.5]], [1.0, 0.0],
                        temperature=0.7),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every case, run once by two gloo processes under FSDP2 (fsdp_worker.py)."""
    out = tmp_path_factory.mktemp("fsdp")
    run_ranks([str(ROOT / "tests/learner/fsdp_worker.py"), str(out)], deadline_s=180)
    return out


@pytest.fixture(scope="module")
def pattern_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every case of ``PATTERN_CASES``, run once by two gloo processes under FSDP2
    (fsdp_patterns_worker.py), within a deadline."""
    out = tmp_path_factory.mktemp("fsdp-patterns")
    run_ranks([str(ROOT / "tests/learner/fsdp_patterns_worker.py"), str(out)], deadline_s=150)
    return out


def assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()  # the Hugging Face names
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, want[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.usefixtures("restore_threads")
def test_fsdp_step_on_two_ranks_equals_one_process_step(
    case: str, two_ranks: Path, tiny_dir: Path
) -> None:
    # Given the step of one process on the batch
    single, stats = run_case(case, load_model(tiny_dir), fixed_groups(), "ddp")
    # When two gloo processes take it with the model sharded by FSDP2
    got = torch.load(two_ranks / f"{case}.pt", weights_only=True)
    # Then loss, gradient norm and the gathered updated weights agree within 1e-5
    assert got["tokens"] == stats.tokens == (16 if CASES[case][1] is None else 6)
    assert got["loss"] == pytest.approx(stats.loss, rel=1e-5, abs=1e-7)
    assert got["grad_norm"] == pytest.approx(stats.grad_norm, rel=1e-5)
    assert got["kl_ref"] == pytest.approx(stats.kl_ref, rel=1e-5, abs=1e-9)
    want = single.model.state_dict()
    assert_same_weights(got["state"], want)
    # and the step moved the weights (the comparison is not between two untouched models)
    base = load_model(tiny_dir).state_dict()
    name = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(base[name], want[name])


@pytest.mark.parametrize("case", list(PATTERN_CASES))
@pytest.mark.usefixtures("restore_threads")
def test_fsdp_step_whose_ranks_differ_in_prefix_finishes_and_equals_one_process(
    case: str, pattern_ranks: Path, tiny_dir: Path
) -> None:
    # Given the step of one process on a batch whose rows share a long prompt on one rank's
    # micro-batch only
    single, stats = run_pattern_case(case, load_model(tiny_dir), "ddp")
    # When two FSDP2 ranks take it (they finished within the fixture's deadline)
    got = torch.load(pattern_ranks / f"patterns-{case}.pt", weights_only=True)
    # Then loss, gradient norm, KL and the gathered updated weights agree with one process
    assert got["tokens"] == stats.tokens
    assert got["loss"] == pytest.approx(stats.loss, rel=1e-5, abs=1e-7)
    assert got["grad_norm"] == pytest.approx(stats.grad_norm, rel=1e-5)
    assert got["kl_ref"] == pytest.approx(stats.kl_ref, rel=1e-5, abs=1e-9)
    assert_same_weights(got["state"], single.model.state_dict())
    # and the step moved the weights
    name = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(load_model(tiny_dir).state_dict()[name], got["state"][name])


def test_each_rank_holds_half_of_the_parameters(two_ranks: Path, tiny_dir: Path) -> None:
    total = sum(p.numel() for p in load_model(tiny_dir).parameters())
    local = [torch.load(two_ranks / f"uneven-rank{r}-shard.pt")["local_numel"] for r in (0, 1)]
    assert sum(local) == total
    assert max(local) <= total // 2 + 64 * 2  # dim-0 shards: at most one row more per tensor


@pytest.mark.usefixtures("restore_threads")
def test_resume_on_one_rank_from_the_sharded_checkpoint(two_ranks: Path, tiny_dir: Path) -> None:
    # Given an uninterrupted process that takes two steps
    straight, _ = run_case("uneven", load_model(tiny_dir), fixed_groups(), "ddp")
    want = straight.step(next_groups())
    # When one process resumes from the checkpoint two FSDP ranks wrote after the first step
    checkpoint = version_dir(two_ranks / "weights", 1)
    assert (checkpoint / SHARDED_DIR).is_dir()
    fields, _ = CASES["uneven"]
    resumed = Trainer(load_model(tiny_dir), TrainConfig(lr=1e-3, num_threads=1, **fields))
    resumed.load_sharded(checkpoint)
    assert resumed.steps == 1
    got = resumed.step(next_groups())
    # Then the next step is the uninterrupted one: loss, gradient norm, weights and moments
    assert got.loss == pytest.approx(want.loss, rel=1e-5, abs=1e-7)
    assert got.grad_norm == pytest.approx(want.grad_norm, rel=1e-5)
    assert resumed.steps == straight.steps == 2
    assert_same_weights(resumed.model.state_dict(), straight.model.state_dict())
    a, b = straight.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    for i in a:
        torch.testing.assert_close(b[i]["exp_avg"], a[i]["exp_avg"], rtol=1e-5, atol=1e-8)
        torch.testing.assert_close(b[i]["exp_avg_sq"], a[i]["exp_avg_sq"], rtol=1e-5, atol=1e-10)


@pytest.mark.usefixtures("restore_threads")
def test_exported_weights_give_the_trained_logits(two_ranks: Path, tiny_dir: Path) -> None:
    # Given the model one process trains with the same step
    single, _ = run_case("uneven", load_model(tiny_dir), fixed_groups(), "ddp")
    # When a fresh Hugging Face model loads the version the FSDP ranks published
    exported = load_model(version_dir(two_ranks / "weights", 1)).eval()
    # Then it gives the trained model's logits
    ids = torch.tensor([[1, 2, 3, 5, 6, 7, 8], [4, 5, 20, 21, 22, 0, 0]])
    mask = (ids > 0).long()
    with torch.no_grad():
        want = single.model.eval()(input_ids=ids, attention_mask=mask).logits
        got = exported(input_ids=ids, attention_mask=mask).logits
        base = load_model(tiny_dir).eval()(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(base, want, atol=1e-5)  # the step changed them
    assert (version_dir(two_ranks / "weights", 1) / "tokenizer.json").exists()
