"""What every verifier harness does the same way: runs INSIDE the sandbox, next to the harness.

Staged by the host (:func:`streamrl.domains.kinds.harness_host.harness_files`) beside the
harness as ``harness_common.py`` (``.harness_common.py`` beside a hidden harness) and loaded by
the harness by path (never through ``sys.path``: under ``-I`` it does not hold the work dir),
before any of the model's code runs; standard library only, no ``streamrl`` import (the
sandbox's system ``python3 -I`` runs it).

What it keeps:
- :func:`harden`: this process non-dumpable (no /proc access to its memory or descriptors by
  a process of the same uid) and, when asked, the subreaper of everything below it (a
  double-forked, ``setsid``-ed or ``nohup``-ed child stays below it);
- :func:`kill_descendants`: SIGKILL everything below this process until nothing is left (a
  fork bomb is outrun: a killed process forks no more), reaped;
- :func:`finish`: a child's process group killed, then everything it left, then its pipes
  drained to EOF (every writer is dead) and closed; :func:`watch`: a child's output read
  until it exits or its deadline, then :func:`finish`;
- :func:`fresh_name`: a random name for a result location nothing before it could know;
- :func:`read_file`: a regular file read without following a link or blocking on a fifo;
- :func:`report`: the one line the host checks, ``<nonce> <json>``.
"""

import contextlib
import ctypes
import json
import os
import secrets
import select
import signal
import stat
import sys
import time

PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER = 4, 36


def harden(subreaper=True):
    """Non-dumpable; the subreaper of every process below this one when ``subreaper``."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None)
        libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
        if subreaper:
            libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def descendants():
    """Every live process below this one (it is their subreaper: orphans stay below it)."""
    children = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        if fields and fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(name))
    found, todo = [], [os.getpid()]
    while todo:
        for pid in children.get(todo.pop(), []):
            found.append(pid)
            todo.append(pid)
    return found


def kill_descendants():
    """SIGKILL everything below this process until nothing is left; reap. False if not."""
    for _ in range(1000):
        pids = descendants()
        if not pids:
            return True
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        time.sleep(0.001)
    return False


def read_ready(readable, bufs, tails):
    """Read what is there into ``bufs[fd]``; a stream at EOF leaves ``bufs``; an fd in
    ``tails`` (fd -> n) keeps about its last n bytes only."""
    for fd in readable:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            del bufs[fd]
            continue
        buf = bufs[fd]
        buf += chunk
        keep = tails.get(fd)
        if keep is not None and len(buf) > 4 * keep:
            del buf[:-keep]


def drain(bufs, tails, wait_s=1.0, full=lambda: False):
    """Every writer is dead: read ``bufs``' streams to EOF, or until a read waits ``wait_s``
    or ``full()``."""
    while bufs and not full():
        readable = select.select(list(bufs), [], [], wait_s)[0]
        if not readable:
            break
        read_ready(readable, bufs, tails)


def finish(proc, bufs, tails, wait_s=1.0, full=lambda: False):
    """Kill ``proc``'s group and everything below this process, drain and close its pipes:
    ``(exit code, clean)``, clean False if some process could not be killed."""
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)
    code = proc.wait()
    clean = kill_descendants()
    if not full():
        drain(bufs, tails, wait_s, full)
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()
    return code, clean


def watch(proc, bufs, tails, timeout_s, poll_s=0.01, wait_s=1.0):
    """Read ``proc``'s pipes (``bufs``, ``tails`` as in :func:`read_ready`) until it exits or
    ``timeout_s``, then :func:`finish` it: ``(timed_out, exit code, clean)``."""
    deadline, timed_out = time.monotonic() + timeout_s, False
    while proc.poll() is None:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        read_ready(select.select(list(bufs), [], [], min(left, poll_s))[0], bufs, tails)
    return (timed_out, *finish(proc, bufs, tails, wait_s))


def fresh_name(prefix, suffix="", nbytes=16):
    """A random file name: a result location nothing that ran before could know."""
    return prefix + secrets.token_hex(nbytes) + suffix


def read_file(path, limit):
    """Up to ``limit`` bytes of the regular file at ``path``, never through a link nor
    blocking on a fifo; None if it is not one."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        return f.read(limit)


def report(nonce, value):
    """The one line the host checks: ``<nonce> <json>``."""
    sys.stdout.write(nonce + " " + json.dumps(value) + "\n")
    sys.stdout.flush()
