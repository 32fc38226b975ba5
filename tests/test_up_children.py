"""The processes ``streamrl up`` starts die with it: after a second SIGTERM (a double Ctrl-C)
no actor, nor the embedded Redis, outlives it; after a SIGKILL no actor does
(runtime/lifeline.py). The real ``streamrl up`` on configs/tiny.toml, processes by pid."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from streamrl.testing.wait import wait_until_sync

REPO = Path(__file__).resolve().parents[1]


def _stat(pid: int) -> tuple[int, str, str] | None:
    """(parent pid, state, start time) of ``pid`` from /proc; None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rpartition(")")[2].split()
    return int(fields[1]), fields[0], fields[19]


def _descendants(root: int) -> dict[int, str]:
    """Every live descendant of ``root``: pid -> its start time (to tell a reused pid)."""
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := _stat(int(entry.name))) is not None:
            table[int(entry.name)] = st
    found: dict[int, str] = {}
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, _, start) in table.items():
            if ppid == parent and pid not in found:
                found[pid] = start
                frontier.append(pid)
    return found


def _alive(pids: dict[int, str]) -> dict[int, str]:
    """Those of ``pids`` still running (not gone, not a zombie, not a reused pid)."""
    out = {}
    for pid, start in pids.items():
        st = _stat(pid)
        if st is not None and st[2] == start and st[1] != "Z":
            out[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    return out


class _Up:
    """The real ``streamrl up`` with its output collected line by line."""

    def __init__(self, work: Path) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMRL_")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "streamrl", "up", "--config", "configs/tiny.toml",
             "--set", "run.name=orphans", "--set", "run.redis_url=",
             "--set", f"run.work_dir={work}", "--max-minutes", "10"],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_for(self, text: str, timeout_s: float) -> None:
        def seen() -> bool:
            assert self.proc.poll() is None, "".join(self.lines)[-3000:]
            return any(text in line for line in self.lines)

        try:
            wait_until_sync(seen, timeout_s)
        except TimeoutError:
            raise AssertionError(f"no {text!r} in:\n" + "".join(self.lines)[-3000:]) from None


def _wait_ready(up: _Up, work: Path, timeout_s: float) -> None:
    """Until every actor's log says it is taking work (its signal handlers are in place)."""

    def ready() -> bool:
        texts = [p.read_text(errors="replace") for p in (work / "logs").glob("*.log")]
        if texts and all('"actor ready"' in t for t in texts):
            return True
        assert up.proc.poll() is None, "".join(up.lines)[-3000:]
        return False

    try:
        wait_until_sync(ready, timeout_s, 0.5)
    except TimeoutError:
        raise AssertionError("actors not ready:\n" + "".join(up.lines)[-3000:]) from None


def _start(tmp_path: Path) -> tuple[_Up, dict[int, str]]:
    work = tmp_path / "run"
    up = _Up(work)
    up.wait_for("streamrl: started", 240)
    _wait_ready(up, work, 240)
    children = _descendants(up.proc.pid)
    assert len(children) >= 6, children  # redis, scheduler, generator, executor, ..., learner
    return up, children


def _gone_within(pids: dict[int, str], timeout_s: float) -> dict[int, str]:
    """Those of ``pids`` still alive after up to ``timeout_s`` (empty once all are gone)."""
    with contextlib.suppress(TimeoutError):
        wait_until_sync(lambda: not _alive(pids), timeout_s)
    return _alive(pids)


def _kill_leftovers(pids: dict[int, str]) -> None:
    for pid in _alive(pids):
        os.kill(pid, signal.SIGKILL)


@pytest.mark.system
def test_no_child_outlives_up_after_a_second_sigterm(tmp_path: Path) -> None:
    # Given a running `streamrl up` and every process it started
    up, children = _start(tmp_path)
    try:
        # When it gets SIGTERM, and again while it is shutting down (a double Ctrl-C)
        up.proc.send_signal(signal.SIGTERM)
        up.wait_for("interrupted, shutting down", 30)
        time.sleep(0.5)
        up.proc.send_signal(signal.SIGTERM)
        up.proc.wait(timeout=60)
        # Then within a few seconds of its exit none of them is left
        left = _gone_within(children, 5.0)
        assert not left, f"outlived `up` by 5 s: {left}\n" + "".join(up.lines)[-2000:]
    finally:
        up.proc.kill()
        _kill_leftovers(children)


@pytest.mark.system
def test_no_actor_outlives_a_killed_up(tmp_path: Path) -> None:
    # Given a running `streamrl up` and the actors it started
    up, children = _start(tmp_path)
    actors = {p: s for p, s in children.items() if "-m streamrl run " in _alive({p: s}).get(p, "")}
    assert len(actors) >= 5, children
    try:
        # When it is killed outright (no chance to stop anything)
        up.proc.kill()
        up.proc.wait(timeout=10)
        # Then every actor exits by itself within a few seconds (the embedded Redis, which
        # cannot watch the lifeline, is left to the test to stop)
        left = _gone_within(actors, 5.0)
        assert not left, f"outlived a killed `up` by 5 s: {left}"
    finally:
        _kill_leftovers(children)
