"""The terminal domain end to end with the real (tiny, random) model: the real CLI, every
actor as its own process under its own Redis ACL user, a real Redis, the process sandbox.

The tiny model scores about 0, which is fine: this checks the pipeline. Episodes take
several turns (the model rarely writes ``<done>``), the observations are fed back, the
trajectories reach the learner and a step is trained on them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest
import redis
import torch

from streamrl.learner.batch import build_batch
from streamrl.learner.train import TrainConfig, Trainer, token_logprobs
from streamrl.models import load_model, resolve_model
from tests.up_run import run_up

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.system
def test_terminal_domain_trains_with_the_tiny_model(redis_url: str, tmp_path: Path) -> None:
    done = run_up(redis_url, tmp_path, {
        "scheduler.domains": '["terminal"]',
        "scheduler.group_size": "2",
        "scheduler.max_new_tokens": "12",
        "scheduler.eval_items": "2",
        "scheduler.eval_every": "0",
        "domain.terminal.max_turns": "2",
        "learner.max_steps": "1",
        "learner.groups_per_step": "1",
    }, prefix="mt")
    run = done.run
    assert done.summary["steps"] >= 1 and done.summary["dead_letters"] == 0

    r = redis.Redis.from_url(redis_url)
    trajectories = done.trajectories()
    assert trajectories
    for t in trajectories:
        ep = t.rollout.task.episode
        assert ep is not None and all(ep.ended) and len(t.outcomes) == len(t.rewards) == 2
        for s in t.rollout.samples:
            # one or two model turns; after the first, the observation went in, masked out
            assert 1 <= len(s.turns) <= 2 and s.turns[0].observation
            mask = np.frombuffer(s.mask, dtype=np.uint8)
            assert len(mask) * 4 == len(s.tokens) and mask.sum() > 0
            assert (mask == 0).any() == (len(s.turns) == 2)
    assert any(len(s.turns) == 2 for t in trajectories for s in t.rollout.samples)
    # `streamrl replay show` prints every turn of an episode: each reply and observation
    t = next(t for t in trajectories if any(len(s.turns) == 2 for s in t.rollout.samples))
    shown = subprocess.run(
        [sys.executable, "-m", "streamrl", "replay", "show", "--episode", t.episode_id,
         "--config", "configs/tiny.toml", "--set", f"run.name={run}",
         "--set", f"run.work_dir={done.work_dir}", "--set", "auth.enabled=false",
         "--source", "live"],
        cwd=REPO, env={"STREAMRL_REDIS_URL": redis_url, "PATH": "/usr/bin:/bin",
                       "HOME": str(Path.home())},
        capture_output=True, text=True, timeout=120,
    )
    assert shown.returncode == 0, shown.stderr[-2000:]
    for s in t.rollout.samples:
        for k, turn in enumerate(s.turns, 1):
            assert f"--- model turn {k}/{len(s.turns)}" in shown.stdout
            # (compared with whitespace collapsed: the text mode of subprocess reads the
            # random model's "\r\n" as "\n")
            assert " ".join(turn.text.split())[:40] in " ".join(shown.stdout.split())
            assert turn.observation.splitlines()[0] in shown.stdout
    # the learner trained a step on them; every role's ACL sufficed (the executor writes the
    # next turn into tasks)
    metrics = done.metrics()
    assert metrics and metrics[0].groups >= 1
    refused = [e for e in r.acl_log(count=128) if e["username"].startswith(f"streamrl-{run}-")]
    assert refused == []

    # The rewards are all 0 (no GRPO signal), so that step moved nothing. What it would train
    # on is checked here: on the episodes the real engine sampled under v0, the learner's
    # recomputed logprobs at the loss-mask positions equal the behaviour logprobs (so the
    # mask sits exactly on the model's tokens, observations excluded), and a step with a
    # reward difference between the members trains exactly those tokens.
    v0 = [t for t in trajectories
          if all((s.token_versions() == 0).all() for s in t.rollout.samples)]
    assert v0
    model = load_model(resolve_model("tiny"))
    batch = build_batch(v0, pad_id=model.config.pad_token_id or 0)
    with torch.no_grad():
        new = token_logprobs(model, batch)
    keep = batch.loss_mask.bool()
    assert torch.allclose(new[keep], batch.old_logprobs[keep], atol=2e-3)
    signal = [msgspec.structs.replace(t, rewards=[1.0, 0.0]) for t in v0]
    stats = Trainer(model, TrainConfig(lr=1e-4)).step(signal)
    assert not stats.skipped and stats.tokens == int(batch.loss_mask.sum())
    assert np.isfinite(stats.loss) and stats.grad_norm > 0
