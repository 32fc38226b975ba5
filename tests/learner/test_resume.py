"""Exact resume: N steps straight equal N/2 steps, a checkpoint, a fresh process state and
N/2 more, bit for bit (weights, AdamW moments, RNG draws for dropout)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from streamrl.learner.checkpoint import load_trainer_state, save_trainer_state
from streamrl.learner.train import TrainConfig, Trainer
from streamrl.learner.weights import save_weights, version_dir
from streamrl.models import load_model
from streamrl.protocol.messages import Trajectory
from streamrl.testing.messages import make_trajectory

STEPS = 4


def _batches() -> list[list[Trajectory]]:
    rng = random.Random(7)
    out = []
    for _ in range(STEPS):
        comps = [[rng.randrange(3, 2000) for _ in range(rng.randint(1, 6))] for _ in range(4)]
        lps = [[-rng.uniform(1, 8) for _ in c] for c in comps]
        out.append([make_trajectory([1, 2, 3], comps, lps, [1.0, 0.0, 0.5, 0.0],
                                    temperature=0.8)])  # fmt: skip
    return out


def _next_draws() -> tuple[list[float], float, float]:
    return torch.rand(3).tolist(), float(np.random.rand()), random.random()


def _trainer(model_dir: Path) -> Trainer:
    """A trainer as a new process makes it: every RNG seeded from the run's seed."""
    random.seed(1)
    np.random.seed(1)
    model = load_model(model_dir)
    model.config.attention_dropout = 0.3  # the step now draws random numbers
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.3
    return Trainer(model, TrainConfig(lr=1e-3, seed=5, micro_batch_size=2))


def _scramble_rngs() -> None:
    """What a new process would have: unrelated RNG states."""
    torch.manual_seed(12345)
    random.seed(12345)
    np.random.seed(12345)


def test_resume_after_a_crash_is_bit_identical(tiny_dir: Path, tmp_path: Path) -> None:
    batches = _batches()
    # Given a run of N steps straight
    straight = _trainer(tiny_dir)
    for b in batches:
        straight.step(b)
        np.random.rand(), random.random()  # code that draws from the other RNGs too
    straight_next = _next_draws()

    # When another run stops after N/2 steps with a checkpoint (as the learner actor saves)
    first = _trainer(tiny_dir)
    for b in batches[: STEPS // 2]:
        first.step(b)
        np.random.rand(), random.random()

    def extra(d: Path) -> None:
        save_trainer_state(first.optimizer, first.steps, d, rng=first.state_dict()["rng"])

    save_weights(first.model, tiny_dir, tmp_path, STEPS // 2, keep_last=2, extra=extra)
    _scramble_rngs()
    # and resumes from it in a fresh trainer for the other N/2
    resumed = _trainer(version_dir(tmp_path, STEPS // 2))
    state = load_trainer_state(version_dir(tmp_path, STEPS // 2))
    assert state is not None
    resumed.load_optimizer_state(state)
    for b in batches[STEPS // 2 :]:
        resumed.step(b)
        np.random.rand(), random.random()

    # Then weights, optimiser moments and step counts are identical, bit for bit
    assert resumed.steps == straight.steps == STEPS
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    sa, sb = straight.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert all(torch.equal(sa[i]["exp_avg_sq"], sb[i]["exp_avg_sq"]) for i in sa)
    # and so are the next draws of every RNG
    assert _next_draws() == straight_next


def test_resume_without_the_rng_state_differs(tiny_dir: Path, tmp_path: Path) -> None:
    """The RNG part of the checkpoint matters: the same resume, RNG state dropped, differs."""
    batches = _batches()
    straight = _trainer(tiny_dir)
    for b in batches:
        straight.step(b)
    first = _trainer(tiny_dir)
    for b in batches[: STEPS // 2]:
        first.step(b)
    state = first.state_dict()
    del state["rng"]
    _scramble_rngs()
    resumed = _trainer(tiny_dir)
    resumed.model.load_state_dict(first.model.state_dict())
    resumed.load_optimizer_state(state)
    for b in batches[STEPS // 2 :]:
        resumed.step(b)
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    assert not all(torch.equal(a[k], b[k]) for k in a)
