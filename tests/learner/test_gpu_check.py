"""benchmarks/gpu/check.sh runs its three parts end to end on the CPU (tiny config) and prints
their figures; a part that fails or runs out of time is an error in the JSON, not the end."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def check(*args: str) -> dict[str, Any]:
    proc = subprocess.run(
        ["bash", "benchmarks/gpu/check.sh", "--cpu", "--tiny", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    out: dict[str, Any] = json.loads(proc.stdout)
    return out


def test_every_part_measures_on_the_cpu_with_a_tiny_config() -> None:
    # When the check runs all its parts, small
    out = check(
        "--samples", "8", "--prompt-len", "8", "--completion-len", "16", "--steps", "2",
        "--gen-batches", "1,4", "--gen-prompt-len", "8", "--gen-new-tokens", "6",
        "--bucket-mb", "1",
    )  # fmt: skip
    assert out["parts"] == ["learner", "generation", "weight_sync"]
    assert not [p for p in out["parts"] if "error" in out[p]], out

    # Then the learner stepped under FSDP2 and plainly: the same step (one rank), timed
    learner = out["learner"]
    assert learner["parameters"] > 0 and learner["world_size"] == 1
    fsdp, plain = learner["fsdp"], learner["ddp"]
    assert fsdp["wrapper"] == "FSDP2 fully_shard"
    assert plain["wrapper"].startswith("none")
    for mode in (fsdp, plain):
        assert mode["step_s_median"] > 0 and mode["tokens_per_s"] > 0
        assert mode["model_flops_per_step"] > 0 and mode["achieved_tflops"] > 0
        assert mode["mfu"] is None  # no peak for a CPU
        assert mode["grad_norm"] > 0  # a real backward pass happened
    assert abs(fsdp["grad_norm"] - plain["grad_norm"]) <= 1e-4 * plain["grad_norm"]
    assert abs(fsdp["loss"] - plain["loss"]) <= 1e-5

    # And the engine generated exactly the asked tokens at each batch size
    gen = out["generation"]
    assert [b["batch"] for b in gen["batches"]] == [1, 4]
    for b in gen["batches"]:
        assert b["tokens"] == b["batch"] * 6 and b["finish_reasons"] == {"length": b["batch"]}
        assert b["tokens_per_s"] > 0 and b["completions_per_s"] > 0

    # And the server served the learner's new weights after each sync, and not the old ones
    sync = out["weight_sync"]
    assert sync["broadcast"]["buckets"] > 1  # bucketed
    for path, version in (("broadcast", "1"), ("disk", "2")):
        figures = sync[path]
        assert figures["verified"] and figures["changed"], figures
        assert figures["served_version"] == version
    assert sync["broadcast"]["broadcast_s"] > 0 and sync["disk"]["total_s"] > 0


def test_a_failing_part_is_reported_and_the_next_one_runs() -> None:
    # When the learner part raises and the generation part outlives its budget
    out = check("--parts", "learner,generation", "--micro-batch-size", "0",
                "--budget", "generation=0.5")  # fmt: skip
    # Then both are in the JSON with their errors
    assert out["learner"]["error"].startswith("ValueError: invalid TrainConfig")
    assert out["learner"]["world_size"] == 1  # what it measured before the error
    assert "budget of 0.5 s" in out["generation"]["error"]
