"""``streamrl up --autoscale``: the policy on hand-made backlog windows (cli/autoscale.py
``decide``), and a real run under ``streamrl up`` built to be executor-bound, whose
bottleneck is scaled up, then back down when the load goes away, losing nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis

from streamrl.cli.autoscale import Change, decide
from streamrl.protocol import names as N

REPO = Path(__file__).resolve().parents[2]
BASE = {"generator": 1, "executor": 1, "verifier": 1}
CONCURRENCY = {"generator": 4, "executor": 2, "verifier": 8}


def window(n: int = 3, **streams: tuple[int, int]) -> list[dict[str, tuple[int, int]]]:
    quiet = {N.TASKS: (0, 0), N.ROLLOUTS: (0, 0), N.EXECUTED: (0, 0)}
    return [{**quiet, **{getattr(N, k.upper()): v for k, v in streams.items()}}] * n


def run(history: list[dict[str, tuple[int, int]]], replicas: dict[str, int] | None = None,
        room: int = 8, max_replicas: int = 4) -> Change | None:
    return decide(history, replicas or dict(BASE), BASE, CONCURRENCY, lag=1,
                  max_replicas=max_replicas, room=room)


def test_the_most_downstream_backlogged_stage_gets_a_replica() -> None:
    # the executor is slow: its input lags, and backpressure makes the tasks lag too
    change = run(window(tasks=(5, 4), rollouts=(3, 2)))
    assert change is not None and (change.stage, change.delta) == ("executor", 1)
    assert run(window(tasks=(5, 4))) == Change("generator", 1, change.why.replace(
        "rollouts: lag 3..3", "tasks: lag 5..5"))


def test_the_most_downstream_stage_with_every_slot_busy_gets_a_replica() -> None:
    # no lag anywhere (the staleness bound and backpressure hold the pipeline back), but the
    # executor's 2 slots are busy in every sample, and so are the generator's 4
    change = run(window(tasks=(0, 4), rollouts=(0, 2)))
    assert change is not None and (change.stage, change.delta) == ("executor", 1)
    assert "every slot busy" in change.why
    assert run(window(tasks=(0, 4), rollouts=(0, 1))).stage == "generator"  # type: ignore[union-attr]
    history = window(2, tasks=(0, 3), rollouts=(0, 2)) + window(1, rollouts=(0, 1))
    assert run(history) is None  # a slot that came free is no reason


def test_a_lag_that_came_and_went_is_no_reason() -> None:
    history = window(2, rollouts=(3, 2)) + window(1, rollouts=(0, 1))  # and a slot came free
    assert run(history) is None


def test_the_budget_and_the_maximum_hold_and_nothing_upstream_is_added_instead() -> None:
    busy = window(tasks=(5, 4), rollouts=(3, 2))
    assert run(busy, room=0) is None
    assert run(busy, {**BASE, "executor": 4}) is None  # not the generator in its place


def test_an_idle_stage_above_its_base_loses_a_replica_when_the_rest_can_take_its_work() -> None:
    replicas = {**BASE, "executor": 3}
    change = run(window(rollouts=(0, 4)), replicas)  # 4 pending fit in 2 x 2
    assert change is not None and (change.stage, change.delta) == ("executor", -1)
    assert run(window(rollouts=(0, 5)), replicas) is None  # 5 do not
    assert run(window(rollouts=(0, 0))) is None  # never below the base count


# ------------------------------------------------------------------------- under `up`


class Lines:
    """The lines ``up`` prints, read as they come."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self.done = threading.Event()
        assert proc.stdout is not None
        stdout = proc.stdout

        def read() -> None:
            for line in stdout:
                self.lines.append(line)
            self.done.set()

        threading.Thread(target=read, daemon=True).start()

    def wait_for(self, text: str, timeout: float) -> str:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            found = next((x for x in self.lines if text in x), None)
            if found is not None:
                return found
            if self.done.is_set():
                break
            time.sleep(0.5)
        raise AssertionError(f"no line with {text!r} in:\n" + "".join(self.lines[-60:]))


@pytest.mark.system
def test_up_scales_the_bottleneck_up_and_back_down_and_loses_nothing(
    redis_url: str, tmp_path: Path
) -> None:
    run_name = f"as{uuid.uuid4().hex[:8]}"
    overrides = {
        "run.name": run_name, "run.work_dir": str(tmp_path / "run"),
        # executor-bound by construction: each group is 32 programs run one after another in
        # one sandbox (a python3 start each, tens of ms), while the tiny model writes the 32
        # four-token samples of a group in one short batch and learns from it in well under a
        # second; the generator runs 8 tasks at once ahead of the executor (staleness 4)
        "scheduler.domains": '["code"]', "scheduler.group_size": "32",
        "scheduler.max_new_tokens": "4",
        "scheduler.max_backlog": "16", "scheduler.eval_items": "1", "scheduler.eval_every": "0",
        "generator.concurrency": "8",
        "learner.max_staleness": "4", "executor.concurrency": "1", "executor.pool_size": "1",
        "up.autoscale_interval_s": "2", "up.autoscale_window": "3",
        "up.autoscale_max_replicas": "3",
    }
    sets = [arg for k, v in overrides.items() for arg in ("--set", f"{k}={v}")]
    env = {"STREAMRL_REDIS_URL": redis_url, "PATH": "/usr/bin:/bin", "HOME": str(Path.home()),
           "PYTHONUNBUFFERED": "1"}
    summary_path = tmp_path / "summary.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamrl", "up", "--config", "configs/tiny.toml", *sets,
         "--autoscale", "--max-minutes", "6", "--summary-json", str(summary_path)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = Lines(proc)
    try:
        # on a quiet machine the executor's one slot is busy throughout and it gets the
        # replica (3 runs of 3); on a loaded one (CI: two test workers on 2 cores) the
        # generator's 8 slots can fill first, as its tasks wait for their weights version
        up = lines.wait_for("autoscale: ", 180)
        stage = up.split("autoscale: ")[1].split()[0]
        assert stage in ("executor", "generator"), up
        assert f"{stage} 1 -> 2" in up and ("lag" in up or "every slot busy" in up), up
        # the load goes away: the operator's quarantine stops new admissions
        r = redis.Redis.from_url(redis_url)
        why = {"failed": 0, "groups": 0, "causes": {}, "at": time.time()}
        r.hset(N.Names(run_name).quarantine, "code", json.dumps(why))
        down = lines.wait_for(f"autoscale: {stage} 2 -> 1 (", 240)
        assert "no lag" in down, down
        # what was admitted before the quarantine finishes its way (nothing pending anywhere)
        names = N.Names(run_name)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and any(
                g["lag"] or g["pending"] for stream in (N.TASKS, N.ROLLOUTS, N.EXECUTED)
                for g in r.xinfo_groups(names.stream(stream))):
            time.sleep(1)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=240)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    lines.done.wait(10)
    assert proc.returncode == 0, "".join(lines.lines[-80:])
    summary: Any = json.loads(summary_path.read_text())
    assert summary["dead_letters"] == 0
    code = summary["domains"]["code"]
    # every group admitted was verified and trained: nothing lost on the way down
    assert code["admitted"] == code["trained"] > 0
    logs = tmp_path / "run" / "logs"
    assert (logs / f"{stage}-1.log").exists()  # the added replica ran
