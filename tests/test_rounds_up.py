"""Post-training rounds through the real ``streamrl up``: real actors as processes, the tiny
model, the test session's Redis (cli/rounds.py).

How a kept domain is made to fall, deterministically: ``word`` is an evaluation-only
declared domain whose every held-out item's answer is ``yes`` (the ``regex`` kind: the last
``yes``/``no`` in the completion). The held-out rounds decode greedily, so the rewards
depend on the weights alone. Stage ``teach`` is SFT at a high learning rate on chat rows
answering ``yes`` to those prompts: the tiny model then answers ``yes`` (reward 1 on every
item, gate ``reach`` passes). Stage ``unteach`` is SFT on the same prompts answering ``no``:
greedy decoding then says ``no`` (reward 0), a fall of 1 against a margin of 0.2, so the
stage is rolled back.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import redis
from safetensors.torch import load_file

from streamrl.learner.weights import version_dir
from streamrl.protocol import names as N
from streamrl.protocol.messages import Trajectory, WeightsPublished
from streamrl.queues.codec import decode
from streamrl.testing.wait import wait_until_sync
from tests.up_run import REPO, run_up

PROMPTS = [f"Is {n} a number? Reply yes or no." for n in range(6)]


def _data(tmp_path: Path) -> dict[str, Path]:
    """The held-out items of ``word`` and the two SFT data sets."""
    files = {"word": tmp_path / "word.jsonl", "yes": tmp_path / "yes.jsonl",
             "no": tmp_path / "no.jsonl"}
    files["word"].write_text("".join(
        json.dumps({"id": f"w{i}", "prompt": p, "answer": "yes"}) + "\n"
        for i, p in enumerate(PROMPTS)))
    for reply in ("yes", "no"):
        files[reply].write_text("".join(
            json.dumps({"messages": [{"role": "user", "content": p},
                                     {"role": "assistant", "content": reply}]}) + "\n"
            for p in PROMPTS))
    return files


def _config(tmp_path: Path, unteach_steps: int = 3) -> str:
    """configs/tiny.toml with the ``word`` domain and the two stages."""
    files = _data(tmp_path)
    sft = ('"learner.mode" = "sft", "learner.lr" = 3e-2, "learner.sft.examples_per_step" = 6, '
           '"learner.sft.data" = ')
    text = (REPO / "configs" / "tiny.toml").read_text() + f"""
[domain.word]
kind = "regex"
data = "{files['word']}"
split = {{ by = "none" }}
verifier = {{ pattern = "(yes|no)", compare = "exact" }}

[[rounds.stage]]
name = "teach"
steps = 3
overrides = {{ {sft}"{files['yes']}" }}
reach = {{ word = 0.5 }}

[[rounds.stage]]
name = "unteach"
steps = {unteach_steps}
overrides = {{ {sft}"{files['no']}" }}
keep = ["word"]
forgetting_margin = 0.2
"""
    path = tmp_path / "rounds.toml"
    path.write_text(text)
    return str(path)


SETTINGS = {"scheduler.eval_domains": '["word"]', "scheduler.eval_items": "6",
            "ops.archive": "false"}


@pytest.mark.system
def test_a_stage_that_makes_a_kept_domain_forget_is_rolled_back(
    redis_url: str, tmp_path: Path
) -> None:
    # Given two SFT stages: teach answers `yes` (word's reward up), unteach answers `no`
    # When `up` runs the sequence
    done = run_up(redis_url, tmp_path, SETTINGS, prefix="rounds", config=_config(tmp_path),
                  max_minutes=8, timeout_s=540)
    teach, unteach = done.summary["rounds"]
    # Then teach passed its reach gate and unteach was rolled back, saying why
    assert teach["outcome"] == "passed", teach
    assert teach["after"]["word"] >= 0.5
    assert unteach["outcome"] == "rolled_back", unteach
    assert unteach["before"]["word"] == teach["after"]["word"]
    assert unteach["after"]["word"] < unteach["before"]["word"] - 0.2
    assert unteach["reason"].startswith("forgetting: word fell from")
    assert unteach["gates"]["keep"]["word"]["ok"] is False
    # and its start (teach's end weights) was published as a newer version
    start, end = unteach["start_version"], unteach["end_version"]
    back = unteach["rollback_version"]
    assert (start, end, back) == (teach["end_version"], start + 3, end + 1)
    restored = load_file(str(version_dir(done.work_dir / "weights", back) / "model.safetensors"))
    kept = load_file(str(done.work_dir / "rounds" / f"start-v{start:06d}" / "model.safetensors"))
    assert restored.keys() == kept.keys()
    assert all(restored[k].equal(kept[k]) for k in kept)
    # which the learner announced and the generators served: the last round was decoded by it
    r = redis.Redis.from_url(redis_url)
    names = N.Names(done.run)
    announced = [decode(f[b"d"], WeightsPublished) for _, f in r.xrange(names.stream(N.WEIGHTS))]
    assert announced[-1].version == back
    evals = [decode(f[b"d"], Trajectory) for _, f in r.xrange(names.stream(N.EVALS))]
    last = max(t.rollout.task.eval_round for t in evals)
    served = {s.weight_version for t in evals if t.rollout.task.eval_round == last
              for s in t.rollout.samples}
    assert served == {back}
    # and its held-out reward is teach's again (greedy decoding of the same weights)
    assert unteach["rollback_eval"]["word"] == teach["after"]["word"]
    assert "unteach: v" in done.stdout and "rolled_back" in done.stdout
    # and `streamrl status` says the same
    env = {"STREAMRL_REDIS_URL": redis_url, "PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
    status = subprocess.run(
        [sys.executable, "-m", "streamrl", "status", "--config",
         str(done.work_dir / "config.json"), "--samples", "1"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert status.returncode == 0, status.stderr
    assert "rounds: 2 of 2 stages judged, done" in status.stdout
    fell = f"{unteach['before']['word']:.3f} to {unteach['after']['word']:.3f}"
    assert (f"unteach: v{start} -> v{end} rolled_back: forgetting: word fell from {fell}, "
            f"more than the margin 0.2, v{start}'s weights published as v{back}"
            in status.stdout), status.stdout


def _one_stage(tmp_path: Path, steps: int) -> str:
    """configs/tiny.toml with one SFT stage of ``steps`` steps (no gate)."""
    files = _data(tmp_path)
    sft = f'"learner.mode" = "sft", "learner.sft.examples_per_step" = 2, ' \
          f'"learner.sft.data" = "{files["yes"]}"'
    text = (REPO / "configs" / "tiny.toml").read_text() + f"""
[[rounds.stage]]
name = "sft"
steps = {steps}
overrides = {{ {sft} }}
"""
    path = tmp_path / "one.toml"
    path.write_text(text)
    return str(path)


@pytest.mark.system
def test_up_continues_an_interrupted_stage_and_ends_a_judged_sequence_at_once(
    redis_url: str, tmp_path: Path
) -> None:
    config = _one_stage(tmp_path, steps=12)
    work = tmp_path / "run"
    settings = {"run.name": f"rres{uuid.uuid4().hex[:8]}", "ops.archive": "false"}
    sets = [a for k, v in {**settings, "run.work_dir": str(work)}.items()
            for a in ("--set", f"{k}={v}")]
    env = {"STREAMRL_REDIS_URL": redis_url, "PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
    # Given `up` interrupted (SIGINT) once the stage's learner has published v2 of its 12
    first = subprocess.Popen(
        [sys.executable, "-m", "streamrl", "up", "--config", config, *sets,
         "--max-minutes", "5"], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    try:
        wait_until_sync(lambda: version_dir(work / "weights", 2).is_dir(), timeout=420,
                        what="the stage's second step")
        os.kill(first.pid, signal.SIGINT)
        out, _ = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, out[-3000:]
    state = json.loads((work / "rounds.json").read_text())
    (interrupted,) = state["stages"]
    assert interrupted["outcome"] == "" and interrupted["start_version"] == 0
    reached = max(int(p.name[1:]) for p in (work / "weights").glob("v*"))
    assert 2 <= reached < 12, "the stage was not interrupted mid-way"
    # When `up` runs the run again
    done = run_up(redis_url, tmp_path, settings, config=config, max_minutes=5, timeout_s=300)
    # Then it continued the stage: same start, the learner on from the version it reached,
    # trained up to the stage's budget (12 steps from v0), and judged it
    (stage,) = done.summary["rounds"]
    assert (stage["start_version"], stage["end_version"], stage["outcome"]) == (0, 12, "passed")
    assert "stage 'sft' (1 of 1) from policy v0" in done.stdout
    ready = [json.loads(line) for line in done.log("learner-0").splitlines()
             if '"learner ready"' in line]
    assert ready[-1]["policy_version"] >= reached
    # and `up` on the judged sequence ends at once with the summary
    again = run_up(redis_url, tmp_path, settings, config=config, max_minutes=5, timeout_s=300)
    assert "every stage of the sequence is judged" in again.stdout
    assert again.summary["rounds"] == done.summary["rounds"]
    assert again.summary["policy_version"] == 12
