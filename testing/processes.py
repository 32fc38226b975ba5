"""The live descendants of this process, read from ``/proc``: what a test checks that a
sandbox, a tracker or a pool did not leave behind."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Descendant:
    pid: int
    parent: int
    cmdline: str  # arguments joined by spaces


def descendants() -> list[Descendant]:
    """Every live (not zombie) process below this one, with its parent and command line."""
    parents: dict[int, int] = {}
    cmdlines: dict[int, str] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    stat = f.read()
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if ") Z " in stat:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            cmdlines[int(entry.name)] = cmd
    me, found = os.getpid(), []
    for pid, cmd in cmdlines.items():
        p = pid
        while p in parents and p not in (0, 1, me):
            p = parents[p]
        if p == me and pid != me:
            found.append(Descendant(pid, parents[pid], cmd))
    return found
