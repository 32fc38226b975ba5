"""The children of ``streamrl up`` die with it, however it ends.

``up`` opens a pipe and keeps its write end, which it never writes to and no other process
holds (Python's pipes are not inherited); every child gets the read end (its number in
``$STREAMRL_LIFELINE_FD``). When ``up`` exits (cleanly, by a second Ctrl-C, by SIGKILL, by a
crash) the kernel closes the write end, the child's watcher thread reads end-of-file and the
child exits at once: no actor keeps reading work, nor retrying a Redis that is gone, for its
reconnect window after its supervisor is gone. What it held is redelivered, as after any
crash.

Not ``prctl(PR_SET_PDEATHSIG)``: its "parent" is the thread that forked the child, and trio
starts processes from worker threads, which exit when idle; the signal would kill healthy
children of a live ``up``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

from streamrl.runtime.logs import get_logger

ENV_LIFELINE_FD = "STREAMRL_LIFELINE_FD"
EXIT_CODE = 75
"""The exit status of a child whose supervisor is gone (EX_TEMPFAIL: nothing wrong with it)."""


@dataclass(frozen=True)
class Lifeline:
    """The supervisor's end: ``read_fd`` goes to every child (``pass_fds`` and
    :meth:`environment`); ``write_fd`` stays open in the supervisor until it exits."""

    read_fd: int
    write_fd: int

    def environment(self) -> dict[str, str]:
        return {ENV_LIFELINE_FD: str(self.read_fd)}


def open_lifeline() -> Lifeline:
    read_fd, write_fd = os.pipe()
    return Lifeline(read_fd, write_fd)


def exit_with_supervisor(environ: MutableMapping[str, str] = os.environ) -> bool:
    """In a child of ``up`` (``$STREAMRL_LIFELINE_FD`` set): start the thread that exits this
    process when ``up`` is gone. The variable is removed and the descriptor made
    non-inheritable, so this process's own children (sandboxes) do not inherit either.
    True when this process has a supervisor to watch."""
    fd = _lifeline_fd(environ)
    if fd is None:
        return False
    environ.pop(ENV_LIFELINE_FD, None)
    os.set_inheritable(fd, False)
    threading.Thread(target=_watch, args=(fd,), name="lifeline", daemon=True).start()
    return True


def _lifeline_fd(environ: Mapping[str, str]) -> int | None:
    value = environ.get(ENV_LIFELINE_FD, "")
    if not value.isdigit():
        return None
    fd = int(value)
    try:
        os.fstat(fd)
    except OSError:  # not open here: started by hand with the variable set, nothing to watch
        return None
    return fd


def _watch(fd: int) -> None:
    while os.read(fd, 64):  # nothing is ever written: this returns at end-of-file only
        pass
    get_logger().warning("supervisor gone, exiting", code=EXIT_CODE)
    os._exit(EXIT_CODE)  # no clean-up to wait for: nobody restarts or waits for this process
