"""Ranks under torchrun for a test, started one way: ``python -m torch.distributed.run
--standalone --nproc-per-node=N`` from the repository root, one OpenMP thread per rank, within
a deadline. Ranks that wait in different collectives wait for ever, so a run past its
deadline is stopped (SIGTERM, which torchrun passes to its workers in their own sessions;
SIGKILL a minute later) and fails the test with the tail of its output; a run that exits
non-zero fails it the same way.

    out = run_ranks([str(ROOT / "tests/learner/ddp_worker.py"), str(out_dir)], deadline_s=180)
    out = await learner_ranks(["run.name=x", "learner.parallelism=fsdp"], deadline_s=180)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import trio

ROOT = Path(__file__).resolve().parents[1]


def torchrun_argv(target: list[str], nproc: int = 2) -> list[str]:
    """The command line: ``target`` is a script and its arguments, or ``-m module ...``."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", *target]  # fmt: skip


def rank_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _failed(what: str, output: str, deadline_s: float | None = None) -> str:
    why = (f"did not finish within {deadline_s:.0f} s (ranks waiting in different "
           "collectives?)" if deadline_s is not None else "failed")
    return f"torchrun {what} {why}; its output ends:\n{output[-3000:]}"


def run_ranks(target: list[str], *, deadline_s: float, nproc: int = 2) -> str:
    """Run ``target`` on ``nproc`` ranks to its end; its output (stdout and stderr)."""
    proc = subprocess.Popen(torchrun_argv(target, nproc), cwd=ROOT, env=rank_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            output, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        pytest.fail(_failed(" ".join(target), output, deadline_s))
    if proc.returncode != 0:
        pytest.fail(_failed(" ".join(target), output))
    return output


async def _stop(proc: trio.Process) -> None:
    proc.terminate()
    with trio.move_on_after(60):
        await proc.wait()
        return
    proc.kill()


async def learner_ranks(overrides: list[str], *, deadline_s: float, nproc: int = 2) -> str:
    """The learner actor (``streamrl.actors.learner``) on ``nproc`` ranks with these
    ``section.key=value`` overrides, to its end (``learner.max_steps``); its output."""
    target = ["-m", "streamrl.actors.learner", *[f"--set={o}" for o in overrides]]
    with tempfile.TemporaryFile() as out:
        with trio.move_on_after(deadline_s) as deadline:
            proc = await trio.run_process(torchrun_argv(target, nproc), cwd=ROOT, env=rank_env(),
                                          stdout=out, stderr=subprocess.STDOUT, check=False,
                                          deliver_cancel=_stop)  # fmt: skip
        out.seek(0)
        output = out.read().decode(errors="replace")
    if deadline.cancelled_caught:
        pytest.fail(_failed("learner", output, deadline_s))
    if proc.returncode != 0:
        pytest.fail(_failed("learner", output))
    return output
