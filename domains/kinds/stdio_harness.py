"""The stdio kind's harness: runs INSIDE the sandbox, as ``python3 -I stdio_harness.py``.

Input (stdin, read whole first): ``{"nonce", "program", "cases": [{"input", "output"}],
"timeout_s", "budget_s", "max_output", "compare", "float_tol", "max_message"}``.

Why the program cannot forge a pass or read an expected output:
- it never runs in this process: every case is a fresh child (``python3 -I solution.py``,
  its own session) whose stdin is that case's input and nothing else; its stdout and stderr
  are pipes to this process. The expected outputs exist only in this process's memory
  (never in a file, an argument or the environment), and this process is non-dumpable, so
  a child of the same uid can neither read its memory nor open its fds through /proc;
- the comparison happens here, on the bytes the program wrote before its main process
  exited; this process is the subreaper of everything the program starts, and after each
  case every one of those processes is SIGKILLed (a background child that would write the
  answer later, or linger into the next case, is gone), then the pipes are drained to EOF;
- a case past ``timeout_s`` is killed (status ``timeout``); more than ``max_output`` bytes
  of stdout kills it (``truncated``); a nonzero exit is ``error`` with the stderr tail; the
  cases left when the run's ``budget_s`` is spent are ``timeout`` (not run);
- the one line this process prints is ``<nonce> <json list of {name, status, message}>``;
  the nonce comes from the host and is checked there with exit code 0.
Not covered: the program may keep state across cases (files in /tmp): it sees only inputs.
"""

import json
import math
import os
import re
import resource
import select
import signal
import subprocess
import sys
import time
import types

# harness_common.py from beside this file (hidden beside a hidden harness), read as source:
# never through sys.path (the work dir is the model's), never from a cached .pyc
_HERE, _NAME = os.path.split(os.path.abspath(__file__))
common = types.ModuleType("harness_common")
with open(os.path.join(_HERE, ("." if _NAME.startswith(".") else "") + "harness_common.py")) as _f:
    exec(compile(_f.read(), _f.name, "exec"), common.__dict__)
TAIL = 2000
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
       "HOME": os.getcwd(), "PYTHONDONTWRITEBYTECODE": "1"}
_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")


# -- comparison (also imported by the host's tests) --------------------------------------


def lines(text):
    """Lines without trailing whitespace, trailing blank lines dropped (final newline)."""
    out = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while out and not out[-1]:
        out.pop()
    return out


def _same_token(got, want, tol):
    if got == want:
        return True
    if tol <= 0 or not (_NUMBER.fullmatch(got) and _NUMBER.fullmatch(want)):
        return False
    a, b = float(got), float(want)
    return math.isfinite(a) and abs(a - b) <= tol * max(1.0, abs(b))


def same_output(got, want, compare="lines", float_tol=0.0):
    """``exact``: the same text; ``lines``: the same :func:`lines`; ``tokens``: the same
    whitespace-separated tokens. ``float_tol`` > 0: tokens, numbers equal within an absolute
    or relative ``float_tol`` (CodeContests-style)."""
    if compare == "exact":
        return got == want
    if compare == "tokens" or float_tol > 0:
        a, b = got.split(), want.split()
        return len(a) == len(b) and all(
            _same_token(x, y, float_tol) for x, y in zip(a, b, strict=True))
    return lines(got) == lines(want)


# -- processes ----------------------------------------------------------------------------


def _limits(cpu_s):
    """Set in the child before exec: ``cpu_s`` CPU seconds (within the sandbox's own)."""
    def setup():
        hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
        soft = cpu_s if hard == resource.RLIM_INFINITY else min(cpu_s, hard)
        resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return setup


def run_case(program_path, data, timeout_s, max_output):
    """Run the program once on ``data``: ``(status, stdout, stderr tail, exit code)``,
    status ``ok``, ``timeout`` or ``truncated``."""
    proc = subprocess.Popen(
        [sys.executable, "-I", program_path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, start_new_session=True, close_fds=True, env=ENV,
        preexec_fn=_limits(max(1, math.ceil(timeout_s))))
    deadline = time.monotonic() + timeout_s
    out, err, status = bytearray(), bytearray(), "ok"
    bufs = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}
    ins, errs = proc.stdin.fileno(), proc.stderr.fileno()
    os.set_blocking(ins, False)
    pending = memoryview(data)
    if not pending:
        proc.stdin.close()
    while proc.poll() is None and status == "ok":
        left = deadline - time.monotonic()
        if left <= 0:
            status = "timeout"
            break
        readable, writable, _ = select.select(list(bufs), [ins] if pending else [], [],
                                              min(left, 0.01))
        if writable:
            try:
                pending = pending[os.write(ins, pending[:1 << 16]):]
            except OSError:  # the program closed its stdin
                pending = pending[:0]
            if not pending:
                proc.stdin.close()
        common.read_ready(readable, bufs, {errs: TAIL})
        if len(out) > max_output:
            status = "truncated"
    code, _ = common.finish(proc, bufs, {errs: TAIL}, full=lambda: len(out) > max_output)
    if status == "ok" and code == -signal.SIGXCPU:
        status = "timeout"  # its CPU seconds
    if len(out) > max_output:
        status = "truncated"
    return status, bytes(out[:max_output + 1]), bytes(err[-TAIL:]), code


# -- the run ------------------------------------------------------------------------------


def _short(text, limit):
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def judge(spec):
    program = os.path.join(os.getcwd(), "solution.py")
    limit = int(spec.get("max_message", 300))
    budget_end = time.monotonic() + float(spec["budget_s"])
    results = []
    for i, case in enumerate(spec["cases"]):
        name = f"case_{i}"
        left = budget_end - time.monotonic()
        if left <= 0.05:
            results.append({"name": name, "status": "timeout",
                            "message": "not run: the run's time budget was spent"})
            continue
        with open(program, "w") as f:  # fresh each case: the program may have rewritten it
            f.write(spec["program"])
        timeout_s = min(float(spec["timeout_s"]), left)
        status, out, err, code = run_case(program, case["input"].encode(), timeout_s,
                                          int(spec["max_output"]))
        tail = err.decode("utf-8", "replace")[-limit:]
        if status == "timeout":
            message = f"ran past {timeout_s:.2f} s"
        elif status == "truncated":
            message = f"more than {spec['max_output']} bytes of output"
        elif code != 0:
            status, message = "error", f"exit {code if code >= 0 else 128 - code}: {tail}"
        else:
            got = out.decode("utf-8", "replace")
            ok = same_output(got, case["output"], spec["compare"], float(spec["float_tol"]))
            status = "pass" if ok else "fail"
            message = "" if ok else (f"expected {_short(case['output'], limit)!r}, "
                                     f"got {_short(got, limit)!r}")
        results.append({"name": name, "status": status, "message": message})
    return results


def main():
    spec = json.loads(sys.stdin.buffer.read())
    common.harden()
    common.report(spec["nonce"], judge(spec))


if __name__ == "__main__":
    main()
