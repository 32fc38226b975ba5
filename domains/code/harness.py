"""The code domain's test harness: runs INSIDE the sandbox, as ``python3 -I harness.py``.

Its input (stdin, read whole before anything else runs): ``{"nonce", "entry", "source",
"tests": [{"args": [...], "expected": ...}], "timeout_s", "max_result_bytes"}``, and
optionally ``"report": true`` (``code`` with feedback): then each test's
``{name, status, message}`` (pass; fail with the value returned vs the expected one; error
with the exception) instead of a boolean.

Why the submission cannot forge a pass:
- the submission never runs in this process: each test is a fresh child
  (``python3 -I -c RUNNER``, its own session) that gets the source and that test's arguments
  only, never the expected values; the child's stdout/stderr are /dev/null, its result
  travels on a pipe this process reads with a byte cap and a deadline, and the child's
  whole process group is SIGKILLed after each test;
- the comparison happens here, on JSON values, type-strictly (``True`` is not ``1``, a
  subclass is not its base): a value whose type is not a plain JSON type fails, so an
  object whose ``__eq__`` always returns True cannot even be reported;
- this process marks itself non-dumpable, so a child of the same uid cannot read its memory
  or open its file descriptors through /proc; the tests live only in its memory (there is
  no test file to edit or delete);
- the one line this process prints is ``<nonce> <json list of booleans>``; the nonce comes
  from the host and is checked there, together with exit code 0, so a line printed by
  anything else (or a harness that did not finish) is worth nothing.
"""

import contextlib
import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import time

RUNNER = r"""
import json, os, sys
spec = json.loads(sys.stdin.buffer.read())
channel = os.fdopen(os.dup(1), "w")
null = os.open(os.devnull, os.O_WRONLY)
os.dup2(null, 1)
os.dup2(null, 2)
PLAIN = (int, float, str, bool, type(None))
def plain(v, depth=0):
    t = type(v)
    if depth > 20:
        raise TypeError("too deep")
    if t in PLAIN:
        return v
    if t in (list, tuple):
        return [plain(x, depth + 1) for x in v]
    if t is dict and all(type(k) is str for k in v):
        return {k: plain(x, depth + 1) for k, x in v.items()}
    raise TypeError("not a plain value: " + t.__name__)
try:
    namespace = {"__name__": "solution"}
    exec(compile(spec["source"], "solution.py", "exec"), namespace)
    value = plain(namespace[spec["entry"]](*spec["args"]))
    out = json.dumps({"ok": True, "value": value}, allow_nan=False)
except BaseException as exc:
    out = json.dumps({"ok": False, "error": (type(exc).__name__ + ": " + str(exc))[:300]})
channel.write(out)
channel.flush()
"""


def strict_equal(a, b):
    if type(a) is not type(b):
        return False
    if type(a) is list:
        return len(a) == len(b) and all(strict_equal(x, y) for x, y in zip(a, b, strict=True))
    if type(a) is dict:
        return a.keys() == b.keys() and all(strict_equal(a[k], b[k]) for k in a)
    if type(a) is float:
        return abs(a - b) <= 1e-9 * max(1.0, abs(b))
    return a == b


def read_capped(stream, deadline, cap):
    data = b""
    fd = stream.fileno()
    while len(data) <= cap:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            return None
        chunk = os.read(fd, 65536)
        if not chunk:
            return data
        data += chunk
    return None  # over the cap


def short(value, limit=200):
    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit] + "..."


def run_test(spec, test):
    """``(status, message)``: ``pass``, ``fail`` (returned another value) or ``error``."""
    proc = subprocess.Popen(
        [sys.executable, "-I", "-c", RUNNER],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        start_new_session=True, close_fds=True,
    )
    try:
        payload = json.dumps({"source": spec["source"], "entry": spec["entry"],
                              "args": test["args"]}).encode()
        try:
            proc.stdin.write(payload)
            proc.stdin.close()
        except OSError:
            return "error", "the solution's process died before the test"
        raw = read_capped(proc.stdout, time.monotonic() + spec["timeout_s"],
                          spec["max_result_bytes"])
    finally:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    if not raw:
        return "error", "no result: timed out, crashed or flooded its result"
    try:
        result = json.loads(raw)
    except ValueError:
        return "error", "no result: its reply is not JSON"
    if type(result) is not dict or result.get("ok") is not True or "value" not in result:
        error = result.get("error") if type(result) is dict else None
        return "error", str(error or "no result")
    if strict_equal(result["value"], test["expected"]):
        return "pass", ""
    return "fail", f"returned {short(result['value'])}, expected {short(test['expected'])}"


def main():
    spec = json.loads(sys.stdin.buffer.read())
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 0
    outcomes = [run_test(spec, t) for t in spec["tests"]]
    if spec.get("report"):
        results = [{"name": spec["entry"] + "(" + short(t["args"], 80)[1:-1] + ")",
                    "status": status, "message": message}
                   for t, (status, message) in zip(spec["tests"], outcomes, strict=True)]
    else:
        results = [status == "pass" for status, _ in outcomes]
    sys.stdout.write(spec["nonce"] + " " + json.dumps(results) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
