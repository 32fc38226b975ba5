"""The python_tests kind's harness: runs INSIDE the sandbox, as ``python3 -I pytests_harness.py``.

Input (stdin, read whole first): ``{"nonce", "program", "setup", "test", "entry",
"timeout_s", "max_message"}``. ``program`` is the model's code (with the prompt it continues);
``setup`` and ``test`` are the data set's (HumanEval's prompt and ``check(candidate)``
program, MBPP's setup code and asserts).

Why the model's code cannot forge a pass:
- it never runs in this process. It is loaded in a child (``python3 -I -c SERVER``, its own
  session, stdout/stderr/stdin on /dev/null) that answers calls over a private pipe; in this
  process the entry point (and ``candidate``) is a proxy that sends the arguments and gets
  back a *plain value* (JSON with tags for tuple/set/dict/bytes/complex/non-finite floats),
  rebuilt here from builtins: an object whose ``__eq__`` always says True cannot cross;
- so overriding ``check``, monkey-patching builtins or ``sys.modules``, ``sys.exit(0)`` or
  ``os._exit(0)`` before the asserts, printing "PASS", registering ``atexit`` hooks: all of
  it happens in the child and changes nothing here (a dead child makes the calls in flight
  errors, and the next call starts a fresh one);
- every statement of the test program (and of its ``check``) that holds an ``assert`` is
  one test, run here under ``try``: pass, fail (the assertion message) or error (the
  traceback, truncated); a test that a failing setup statement never reached is an error;
- each test has a deadline (``timeout_s`` for all its calls); a child past it is SIGKILLed
  with its process group;
- this process marks itself non-dumpable (no /proc access to its memory or descriptors by
  the child, same uid), and prints one line: ``<nonce> <json list of {name, status,
  message}>``; the nonce comes from the host and is checked there with exit code 0.
Not covered: tests that pass the candidate a function or an object (they cannot cross: the
call is an error), and tests that read a mutation the candidate made to its arguments.
"""

import ast
import builtins
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
import traceback
import types

# harness_common.py from beside this file (hidden beside a hidden harness), read as source:
# never through sys.path (the work dir is the model's), never from a cached .pyc
_HERE, _NAME = os.path.split(os.path.abspath(__file__))
common = types.ModuleType("harness_common")
with open(os.path.join(_HERE, ("." if _NAME.startswith(".") else "") + "harness_common.py")) as _f:
    exec(compile(_f.read(), _f.name, "exec"), common.__dict__)

CODEC = r'''
import math
def enc(v, depth=0):
    t = type(v)
    if depth > 50:
        raise TypeError("too deeply nested")
    if v is None or t is bool or t is int or t is str:
        return v
    if t is float:
        return v if math.isfinite(v) else {"float": repr(v)}
    if t is list:
        return [enc(x, depth + 1) for x in v]
    if t in (tuple, set, frozenset):
        return {t.__name__: [enc(x, depth + 1) for x in v]}
    if t is dict:
        return {"dict": [[enc(k, depth + 1), enc(x, depth + 1)] for k, x in v.items()]}
    if t is bytes:
        return {"bytes": v.hex()}
    if t is complex:
        return {"complex": [enc(v.real), enc(v.imag)]}
    raise TypeError("not a plain value: " + t.__name__)
def dec(v, depth=0):
    t = type(v)
    if depth > 50:
        raise TypeError("too deeply nested")
    if v is None or t in (bool, int, float, str):
        return v
    if t is list:
        return [dec(x, depth + 1) for x in v]
    if t is not dict or len(v) != 1:
        raise TypeError("bad value")
    (tag, x), = v.items()
    if tag == "float" and x in ("nan", "inf", "-inf"):
        return float(x)
    if tag in ("tuple", "set", "frozenset") and type(x) is list:
        return {"tuple": tuple, "set": set, "frozenset": frozenset}[tag](
            dec(y, depth + 1) for y in x)
    if tag == "dict" and type(x) is list:
        return {dec(k, depth + 1): dec(y, depth + 1) for k, y in x}
    if tag == "bytes" and type(x) is str:
        return bytes.fromhex(x)
    if tag == "complex" and type(x) is list and len(x) == 2:
        return complex(dec(x[0]), dec(x[1]))
    raise TypeError("bad tag")
'''

SERVER = CODEC + r'''
import json, os, sys
inp = os.fdopen(os.dup(0), "r")
out = os.fdopen(os.dup(1), "w")
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
def reply(obj):
    out.write(json.dumps(obj) + "\n")
    out.flush()
spec = json.loads(inp.readline())
namespace = {"__name__": "__main__"}
try:
    exec(compile(spec["program"], "solution.py", "exec"), namespace)
    fn = namespace[spec["entry"]]
    reply({"loaded": True})
except BaseException as exc:
    reply({"loaded": False, "error": type(exc).__name__ + ": " + str(exc)[:300]})
    raise SystemExit(0)
for line in inp:
    try:
        call = json.loads(line)
        value = fn(*dec(call["args"]), **dec(call["kwargs"]))
        reply({"value": enc(value)})
    except BaseException as exc:
        reply({"raise": type(exc).__name__, "message": str(exc)[:300]})
'''

codec_ns: dict = {}  # type: ignore[type-arg]
exec(CODEC, codec_ns)
enc, dec = codec_ns["enc"], codec_ns["dec"]


class CandidateError(Exception):
    """The candidate raised an exception that is not a builtin one, or could not be called."""


class Candidate:
    """The model's function, running in a child process; called through a pipe."""

    def __init__(self, program, entry):
        self.program, self.entry = program, entry
        self.proc = None
        self.deadline = float("inf")
        self.load_error = None

    def _start(self):
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-c", SERVER], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
            close_fds=True,
        )
        self._send({"program": self.program, "entry": self.entry})
        loaded = self._receive()
        if not loaded.get("loaded"):
            self.load_error = loaded.get("error", "the solution did not load")
            raise CandidateError(self.load_error)

    def _send(self, obj):
        try:
            self.proc.stdin.write((json.dumps(obj) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:
            self.kill()
            raise CandidateError("the solution's process died") from None

    def _receive(self):
        fd, data = self.proc.stdout.fileno(), b""
        while not data.endswith(b"\n"):
            left = self.deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self.kill()
                raise TimeoutError("the solution ran past the test's deadline")
            chunk = os.read(fd, 1 << 16)
            if not chunk or len(data) > (8 << 20):
                self.kill()
                raise CandidateError("the solution's process died (or flooded its reply)")
            data += chunk
        return json.loads(data)

    def kill(self):
        if self.proc is not None:
            with contextlib.suppress(OSError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.proc = None

    def __call__(self, *args, **kwargs):
        if self.load_error is not None:
            raise CandidateError(self.load_error)
        if self.proc is None:
            self._start()
        self._send({"args": enc(list(args)), "kwargs": enc(kwargs)})
        answer = self._receive()
        if "value" in answer:
            return dec(answer["value"])
        name, message = str(answer.get("raise")), str(answer.get("message"))
        cls = getattr(builtins, name, None)
        if isinstance(cls, type) and issubclass(cls, Exception):
            raise cls(message)
        raise CandidateError(f"{name}: {message}")


def _has_assert(node):
    return any(isinstance(n, ast.Assert) for n in ast.walk(node))


def _wrap(stmts, names, source):
    """Each statement holding an assert becomes ``__begin(i); try: ... except/else: __end``."""
    out = []
    for stmt in stmts:
        if isinstance(stmt, ast.FunctionDef) and stmt.name == "check":
            stmt.body = _wrap(stmt.body, names, source)
            out.append(stmt)
            continue
        if not _has_assert(stmt) or isinstance(stmt, ast.FunctionDef | ast.ClassDef):
            out.append(stmt)
            continue
        i = len(names)
        text = (ast.get_source_segment(source, stmt) or "").strip().splitlines()
        names.append(f"test_{i}: {text[0][:80] if text else ''}")
        wrapped = ast.parse(
            f"__begin({i})\n"
            "try:\n    pass\n"
            f"except AssertionError as __e:\n    __end({i}, 'fail', __e)\n"
            f"except Exception as __e:\n    __end({i}, 'error', __e)\n"
            f"else:\n    __end({i}, 'pass', None)\n"
        ).body
        wrapped[1].body = [stmt]
        out.extend(wrapped)
    return out


def run_tests(spec):
    candidate = Candidate(spec["program"], spec["entry"])
    limit = int(spec.get("max_message", 500))
    tree = ast.parse(spec["test"])
    names = []
    tree.body = _wrap(tree.body, names, spec["test"])
    ast.fix_missing_locations(tree)
    results = {}

    def begin(i):
        candidate.deadline = time.monotonic() + float(spec["timeout_s"])

    def end(i, status, exc):
        message = ""
        if exc is not None:
            if status == "fail":
                message = "AssertionError: " + str(exc) if str(exc) else "AssertionError"
            else:
                message = "".join(traceback.format_exception(exc, limit=-3))
        results[i] = {"name": names[i], "status": status, "message": message[-limit:]}

    namespace = {"__name__": "__check__", "__begin": begin, "__end": end}
    failure = ""
    try:
        if spec.get("setup"):
            exec(compile(spec["setup"], "setup.py", "exec"), namespace)
        namespace[spec["entry"]] = candidate
        namespace["candidate"] = candidate
        exec(compile(tree, "test.py", "exec"), namespace)
        if callable(namespace.get("check")):
            namespace["check"](candidate)
    except Exception as exc:  # a setup statement of the test program failed
        failure = "".join(traceback.format_exception(exc, limit=-3))[-limit:]
    finally:
        candidate.kill()
    return [results.get(i, {"name": name, "status": "error",
                            "message": "not reached: " + (failure or "the check stopped")})
            for i, name in enumerate(names)]


def main():
    spec = json.loads(sys.stdin.buffer.read())
    common.harden(subreaper=False)
    common.report(spec["nonce"], run_tests(spec))


if __name__ == "__main__":
    main()
