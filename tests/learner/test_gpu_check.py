"""benchmarks/gpu/check.sh runs end to end on the CPU (tiny config) and prints its figures."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_script_runs_on_cpu_with_a_tiny_config() -> None:
    proc = subprocess.run(
        ["bash", "benchmarks/gpu/check.sh", "--cpu", "--tiny", "--samples", "8",
         "--prompt-len", "8", "--completion-len", "16", "--steps", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["parameters"] > 0 and out["step_s_median"] > 0
    assert out["tokens_per_s"] > 0 and out["weights_bytes"] > 0
    assert out["grad_norm"] > 0  # a real backward pass happened
    assert out["save_s"] > 0 and out["load_in_place_s"] > 0 and out["load_from_pretrained_s"] > 0
