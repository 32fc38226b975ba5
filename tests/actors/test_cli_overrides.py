"""``--set`` overrides on the real command line: a Redis password given there is visible to
every user of the machine (``ps``), so the CLI warns and points to ``$STREAMRL_REDIS_URL``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _streamrl_config(*overrides: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMRL_")}
    argv = [sys.executable, "-m", "streamrl", "config", "--config", "configs/tiny.toml"]
    for o in overrides:
        argv += ["--set", o]
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    "url", ["redis://:s3cret-pw@127.0.0.1:6379/0", "redis://admin:s3cret-pw@10.0.0.5:6379/0"]
)
def test_a_password_in_a_set_override_is_warned_about(url: str) -> None:
    # When the Redis URL with a password is given on the command line
    proc = _streamrl_config(f"run.redis_url={url}")
    # Then the command still works (its stdout is the config, password masked) ...
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["run"]["redis_url"].endswith("***@" + url.rpartition("@")[2])
    # ... and stderr warns, once in words and once as a structlog event, without the secret
    assert "visible to other users of this machine" in proc.stderr
    assert "$STREAMRL_REDIS_URL" in proc.stderr
    events = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{")]
    [event] = [e for e in events if e.get("event") == "redis password on the command line"]
    assert event["level"] == "warning" and event["use"] == "STREAMRL_REDIS_URL"
    assert "s3cret-pw" not in proc.stderr


@pytest.mark.parametrize(
    "url", ["redis://127.0.0.1:6379/0", "redis://streamrl-user@127.0.0.1:6379/0", ""]
)
def test_a_url_without_a_password_is_not_warned_about(url: str) -> None:
    proc = _streamrl_config(f"run.redis_url={url}", "learner.lr=2e-5")
    assert proc.returncode == 0, proc.stderr
    assert "STREAMRL_REDIS_URL" not in proc.stderr
    assert "password" not in proc.stderr
