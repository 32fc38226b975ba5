"""A Harbor task whose ``tests/test.sh`` crashes without writing a reward, run by ``streamrl
up`` (issue 32 item 3's reproduction): no group of it is trained, every one is dead-lettered
as ``unjudged``, the domain is quarantined for it, and the summary says so; a domain beside
it trains normally. The real CLI, actors, sandbox and tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from streamrl.domains.kinds.harbor import write_harbor_jsonl
from streamrl.protocol import names as N
from streamrl.protocol.messages import Trajectory
from tests.up_run import run_up


def _broken_harbor(root: Path) -> Path:
    """Ten Harbor tasks whose test.sh exits 1 before writing a reward."""
    for i in range(10):
        task = root / f"broken-{i}"
        (task / "tests").mkdir(parents=True)
        (task / "instruction.md").write_text(f"Write the number {i} to /app/out.txt.")
        (task / "tests" / "test.sh").write_text("#!/bin/bash\necho 'fixture missing' >&2\nexit 1\n")
    return write_harbor_jsonl(root, root / "broken.jsonl")


@pytest.mark.system
def test_a_crashing_test_sh_is_never_trained_and_quarantines_its_domain(
    redis_url: str, tmp_path: Path
) -> None:
    data = _broken_harbor(tmp_path / "harbor")
    done = run_up(redis_url, tmp_path, {
        "scheduler.domains": json.dumps(["arith", "broken"]),
        "scheduler.quarantine_after": "3", "scheduler.quarantine_window": "4",
        "domain.broken.kind": "'harbor'", "domain.broken.data": f"'{data}'",
        "learner.max_steps": "3",
    }, prefix="unj", max_minutes=4)
    broken = done.summary["domains"]["broken"]
    # Then none of its groups was trained: each was dead-lettered as unjudged
    assert broken["trained"] == 0
    unjudged = broken["dead_letters"]["by_cause"].get("verifier:unjudged", 0)
    assert unjudged >= 3 and unjudged == broken["dead_letters"]["count"]
    assert done.summary["unjudged"] == unjudged
    assert broken["quarantined"] and "verifier unjudged" in broken["quarantine_reason"]
    assert not any(t.rollout.task.domain == "broken"
                   for t in done.records(N.TRAJECTORIES, Trajectory))
    # while the other domain trained
    assert done.summary["domains"]["arith"]["trained"] > 0 and done.summary["steps"] >= 3
