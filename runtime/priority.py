"""Start a child process at a lower CPU priority, in its own session, as ``streamrl up`` starts
its children (``up.decode_nice``).

A nice value alone does not do it there: with the kernel's session autogroups
(``/proc/sys/kernel/sched_autogroup_enabled``, on in most distributions' kernels) the CPU is
first shared between sessions, each session's group at its own nice value (0 when it is
made), and a process's nice value weighs only against the other processes of its session.
``up`` starts every child in a session of its own (``start_new_session``, so a signal to one
never reaches the others), so each child's priority is its session's: :func:`lower_priority`
sets both."""

from __future__ import annotations

from pathlib import Path


def niced(argv: list[str], nice: int) -> list[str]:
    """``argv`` run under ``nice -n nice`` (every thread it starts inherits it), or as is."""
    return ["nice", "-n", str(nice), *argv] if nice else argv


def autogroups_enabled() -> bool:
    try:
        return Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        return False


def lower_priority(pid: int, nice: int) -> bool:
    """Give the session that process ``pid`` leads (started with ``start_new_session``) the
    nice value ``nice``: its autogroup's, where the kernel has autogroups. Returns whether it
    was set (False without autogroups, or if the kernel refused: the process's own nice value,
    from :func:`niced`, is then what there is)."""
    if not nice or not autogroups_enabled():
        return False
    try:
        Path(f"/proc/{pid}/autogroup").write_text(f"{nice}\n")
    except OSError:
        return False
    return True

