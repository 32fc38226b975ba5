"""``streamrl up`` with ``up.serve_models``: the supervisor starts a serve-model process and
the generator samples through it over the SGLang protocol (the real CLI, real Redis, tiny
model); the policy advances and every rollout names the weights of each of its tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.up_run import run_up


@pytest.mark.system
@pytest.mark.parametrize("weight_sync", ["disk", "broadcast"])
def test_up_starts_serve_model_and_the_generator_uses_it(
    redis_url: str, tmp_path: Path, weight_sync: str
) -> None:
    # (the broadcast run's server holds the policy in bf16: the learner's fp32 buckets are
    # cast as they land)
    dtype = "bfloat16" if weight_sync == "broadcast" else "float32"
    done = run_up(redis_url, tmp_path, {
        "up.serve_models": "1", "learner.max_steps": "2", "learner.weight_sync": weight_sync,
        "generator.dtype": dtype,
    }, prefix=f"srv{weight_sync[:4]}", timeout_s=540)
    summary = done.summary
    assert summary["steps"] >= 2 and summary["dead_letters"] == 0
    assert summary["eval_reward_after"] is not None
    # The serve-model process served the generator and loaded the published weights: from
    # disk through the generator, or over the learner's weight-update group
    served = done.log("serve-model-0")
    generator = done.log("generator-0")
    assert f'"dtype": "{dtype}"' in served
    if weight_sync == "disk":
        assert '"weights updated"' in served or "weights updated" in served
        assert "server weights updated" in generator
    else:
        assert "weights updated from the group" in served
        assert "weights broadcast" in done.log("learner-0")
        assert "server serves the version already" in generator
        assert "server weights updated" not in generator
    # Every trained group carries per-token versions that agree with its samples
    groups = done.trajectories()
    assert groups
    for g in groups:
        for s in g.rollout.samples:
            versions = s.token_versions()
            assert len(versions) == len(s.tokens) // 4
            assert len(versions) == 0 or int(versions.min()) == s.weight_version
