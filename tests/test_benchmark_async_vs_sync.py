"""benchmarks/async_vs_sync.py runs the real actors: a change to them must not break it
silently (it once dead-lettered every task after the generator gained its version gate)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.system
def test_both_modes_train_every_step() -> None:
    done = subprocess.run(
        [sys.executable, "benchmarks/async_vs_sync.py", "--json", "--steps", "3",
         "--timeout-s", "240"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "dead-lettered" not in done.stderr, done.stderr[-3000:]
    result = json.loads(done.stdout)
    for mode in ("sync", "async"):
        assert result[mode]["steps"] == 3
    assert result["sync"]["max_staleness_seen"] == 0 and result["sync"]["dropped_stale"] == 0
    assert result["speedup_async_over_sync"] > 0
