"""The operator commands on a run of the embedded server (no ``run.redis_url``): after the run
has ended they open its data (the server started over ``<run dir>/redis`` for the command),
named by its config or by the merged config ``up`` wrote (``<run dir>/config.json``); and
``up``'s last lines say how to look at the run. Embedded Redis, tiny model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from streamrl.queues.server import hold_data_dir

REPO = Path(__file__).resolve().parents[1]


def _streamrl(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    """The real CLI, with no ``STREAMRL_*`` of this environment (no Redis URL)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMRL_")}
    return subprocess.run([sys.executable, "-m", "streamrl", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout_s)


@pytest.mark.system
def test_report_replay_status_and_dlq_open_a_finished_embedded_run(tmp_path: Path) -> None:
    # Given a finished run of the embedded server (its server stopped with it)
    work = tmp_path / "run"
    run = ("--config", "configs/tiny.toml", "--set", "run.name=opsafter",
           "--set", f"run.work_dir={work}")
    up = _streamrl("up", *run, "--set", "run.redis_url=", "--set", "learner.max_steps=1",
                   "--max-minutes", "2", "--summary-json", str(tmp_path / "summary.json"),
                   timeout_s=300)
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    ended = json.loads((tmp_path / "summary.json").read_text())
    merged = work / "config.json"  # the merged config `up` writes for its actors
    # When the operator commands run on it, by the run's config and by its merged config
    report = _streamrl("report", "--config", str(merged), "--out", str(tmp_path / "report"))
    show = _streamrl("replay", "show", *run, "--source", "live", "--limit", "1")
    status = _streamrl("status", *run, "--json", "--samples", "1")
    dlq = _streamrl("dlq", "list", "--config", str(merged), "--json")
    # Then each answers from the run's own data
    assert report.returncode == 0, report.stderr
    assert (tmp_path / "report" / "summary.md").exists()
    assert show.returncode == 0, show.stderr
    assert show.stdout.startswith("episode "), show.stdout[:500]
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["policy_version"] == ended["policy_version"]
    assert dlq.returncode == 0, dlq.stderr
    assert isinstance(json.loads(dlq.stdout), list)
    # and the server each started over the run's data is gone again: the next one starts
    again = _streamrl("replay", "list", *run, "--source", "live", "--limit", "1")
    assert again.returncode == 0, again.stderr
    # and `up`'s last lines said how to look at the run
    assert f"streamrl report --config {merged} --out {work / 'report'}" in up.stdout
    assert f"streamrl replay show --config {merged}" in up.stdout


def test_without_a_run_the_error_says_what_to_do(tmp_path: Path) -> None:
    # Given no Redis URL and no run in the work directory
    done = _streamrl("status", "--config", "configs/tiny.toml",
                     "--set", f"run.work_dir={tmp_path / 'none'}")
    # Then the command says where it looked and what to give it
    assert done.returncode == 2
    assert str(tmp_path / "none") in done.stderr
    assert "STREAMRL_REDIS_URL" in done.stderr and "--config" in done.stderr


@pytest.mark.system
def test_up_refuses_a_run_whose_data_another_process_holds(tmp_path: Path) -> None:
    # Given a run's data held by another process (an operator command's server over it)
    work = tmp_path / "run"
    with hold_data_dir(work / "redis"):
        # When `up` is started on the run
        up = _streamrl("up", "--config", "configs/tiny.toml", "--set", "run.name=held",
                       "--set", "run.redis_url=", "--set", f"run.work_dir={work}",
                       "--max-minutes", "1", timeout_s=300)
    # Then it starts no second server over the data: it says why and exits non-zero
    assert up.returncode != 0
    assert "is held by another process" in up.stderr, up.stderr[-2000:]
    assert "embedded Redis (" not in up.stdout


def test_up_fresh_removes_nothing_another_process_serves(tmp_path: Path) -> None:
    import trio

    from streamrl.cli.up import _prepare
    from tests.helpers import run_config

    # Given a run's data held by another process (its server over it)
    config = run_config(tmp_path, "", "held", f"run.work_dir={tmp_path / 'run'}")
    aof = config.run.path / "redis" / "appendonly.aof"
    aof.parent.mkdir(parents=True)
    aof.write_text("data\n")
    # When `up --fresh` prepares the run
    with (hold_data_dir(config.run.path / "redis"),
          pytest.raises(SystemExit, match="is held by another process") as refused):
        trio.run(_prepare, config, True)
    # Then it says why and removes nothing from under that server
    assert "left as it is" in str(refused.value)
    assert aof.read_text() == "data\n"
