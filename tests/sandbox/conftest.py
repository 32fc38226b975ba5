"""Fixtures for the sandbox tests: every backend behind one ``backend`` fixture, and a marker
that proves nothing a test started outlives it.

``backend`` yields the process backend always (its strongest isolation mode here, resident
bwrap sandboxes where they work, or ``$STREAMRL_TEST_ISOLATION``), and the Docker backend
when ``open_sandbox("docker")`` works; without an engine the Docker cases skip with the
reason, except under CI (``$CI`` set), where they fail. A module may widen it to the process
backend's fallback modes (:data:`PROCESS_MODES`, named ``process:<mode>``; the attack suite
does) by overriding ``backend_name`` with :func:`usable_backend`: a mode that cannot run here
skips with the reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import trio

from streamrl.sandbox import (
    ExecRequest,
    Limits,
    Sandbox,
    SandboxUnavailable,
    open_sandbox,
    opened,
)
from streamrl.testing.wait import wait_until_sync

BACKENDS = ("process", "docker")
# the process backend's fallback modes, each a backend name of its own (``process:<mode>``):
# per-command bwrap, unshare, and none (a uid switch and rlimits: root only, see _mode_problem)
PROCESS_MODES = ("process:bwrap-per-command", "process:unshare", "process:none")


@pytest.fixture
def marker() -> Iterator[str]:
    """A string put on every sandboxed command line (and used as the session label); no
    process may carry it once the test and its backend are done."""
    tag = f"sbxmark-{uuid.uuid4().hex}"
    yield tag
    try:  # SIGKILLed processes need a moment to vanish
        wait_until_sync(lambda: not processes_with(tag), timeout=2.0, interval=0.05)
    except TimeoutError:
        pytest.fail(f"sandbox processes outlived the test: {processes_with(tag)}")


def processes_with(tag: str) -> list[int]:
    """Host pids whose command line contains ``tag`` (zombies included: they are leftovers)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if tag.encode() in Path(entry.path, "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def containers_with(tag: str) -> list[str]:
    """Docker containers (any state) whose name or labels contain ``tag``."""
    done = subprocess.run(
        ["docker", "ps", "-a", "--no-trunc", "--format", "{{.ID}} {{.Names}} {{.Labels}}"],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    return [line for line in done.stdout.splitlines() if tag in line]


def _unavailable(name: str, reason: str) -> None:
    if name == "docker" and os.environ.get("CI"):
        pytest.fail(f"CI must run the Docker backend, but it is unavailable: {reason}")
    pytest.skip(f"{name} backend unavailable here: {reason}")


def _mode_options(mode: str) -> dict[str, str | bool]:
    """bwrap, bwrap-per-command (no resident sandbox), unshare, none."""
    isolation, _, per_command = mode.partition("-")
    return {"isolation": isolation, "resident": not per_command}


def _options(name: str) -> dict[str, str | bool]:
    """``$STREAMRL_TEST_ISOLATION`` for ``process``; the mode of ``process:<mode>``."""
    if name.startswith("process:"):
        return _mode_options(name.partition(":")[2])
    if name == "process" and os.environ.get("STREAMRL_TEST_ISOLATION"):
        return _mode_options(os.environ["STREAMRL_TEST_ISOLATION"])
    return {}


def open_backend(name: str) -> Sandbox:
    """The backend ``name`` (one of BACKENDS or PROCESS_MODES) with its test options."""
    return open_sandbox(name.partition(":")[0], **_options(name))


def _mode_problem(name: str) -> str | None:
    """Why a process mode is not run here although it works: ``none`` switches uid only as
    root; without root its code would run as the test's own user (reading the test's
    environment, signalling it), which is no sandbox to attack."""
    if name == "process:none" and os.geteuid() != 0:
        return "the 'none' mode isolates by a uid switch, which needs root"
    return None


async def _probe(name: str) -> str | None:
    """Why backend ``name`` cannot run ``true`` here, or None when it can."""
    try:
        box = open_backend(name)
    except (ValueError, ImportError, SandboxUnavailable) as exc:
        return f"{type(exc).__name__}: {exc}"
    try:  # an engine that is installed but down (or absent: no socket) shows only when used
        async with opened(box):
            result = await box.run(ExecRequest(["true"], limits=Limits(timeout_s=60)))
    except SandboxUnavailable as exc:
        return f"SandboxUnavailable: {exc}"
    assert result is not None and result.exit_code == 0, f"{name}: `true` failed: {result}"
    return None


@pytest.fixture(scope="session")
def unavailable() -> dict[str, str | None]:
    """Each backend's reason for being unavailable (probed once per test session)."""
    return {name: trio.run(_probe, name) for name in BACKENDS}


@pytest.fixture(params=BACKENDS)
def backend_name(request: pytest.FixtureRequest, unavailable: dict[str, str | None]) -> str:
    """The backend's name; skips (fails under CI, for Docker) when it cannot run here."""
    return usable_backend(request.param, unavailable)


_mode_reasons: dict[str, str | None] = {}  # per process mode, probed once per session


def usable_backend(name: str, unavailable: dict[str, str | None]) -> str:
    """``name`` where it can run here, else skip (fail under CI, for Docker) with the reason;
    a process mode is probed on first use."""
    if name not in unavailable:  # a process mode: probed on first use
        if name not in _mode_reasons:
            _mode_reasons[name] = _mode_problem(name) or trio.run(_probe, name)
        if _mode_reasons[name] is not None:
            pytest.skip(f"{name} unavailable here: {_mode_reasons[name]}")
        return name
    if unavailable[name] is not None:
        if name == "docker" and os.environ.get("CI"):
            pytest.fail(f"CI must run the Docker backend: {unavailable[name]}")
        pytest.skip(f"{name} backend unavailable here: {unavailable[name]}")
    return name



@pytest.fixture
async def backend(backend_name: str, marker: str) -> AsyncIterator[Sandbox]:
    async with opened(open_backend(backend_name)) as box:
        yield box
    if backend_name == "docker" and shutil.which("docker"):
        assert not containers_with(marker), "containers outlived the test"
