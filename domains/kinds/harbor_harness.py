"""The harbor kind's harness: runs INSIDE the sandbox, as ``python3 -I .harbor_harness.py``,
in the work dir where the task's ``environment/`` files are staged.

Input (stdin, read whole first): ``{"nonce", "script", "tests": {path: base64},
"workdir", "solution_timeout_s", "test_timeout_s", "max_tail"}``.

The steps, in order (Harbor's trial: the agent, then the verifier):
1. the model's script runs (``bash``, the work dir as cwd and HOME, stdin /dev/null) until
   it exits or ``solution_timeout_s``; then every process it left is SIGKILLed (this process
   is their subreaper: a double-forked, ``setsid``-ed or ``nohup``-ed child is still below
   it), before anything of the tests exists;
2. ``tests/`` is written to a fresh directory with a random name under /tmp, the reward
   location ``logs/verifier/`` to another; Harbor's absolute paths (``/tests``, ``/logs``,
   and the agent's work dir ``workdir``, default ``/app``, which a read-only root cannot
   hold) are rewritten to them (and to the work dir) in the text of the test files and of
   the script;
3. ``bash test.sh`` runs (cwd the work dir, a fresh HOME, ``PYTHONNOUSERSITE``) until it
   exits or ``test_timeout_s``; everything it left is killed;
4. the reward is the number in ``logs/verifier/reward.txt`` (else ``reward.json``'s
   ``reward``), read without following links, clamped to [0, 1]; missing or garbage: null
   (the host: the verifier failed, not a 0).

Why the script cannot forge the reward: the tests and the nonce exist only in this
process's memory until step 2, and this process is non-dumpable (no /proc access to its
memory or fds by the same uid); a reward file the script wrote is not at the fresh location;
nothing the script started is alive in steps 2-4; killing or stopping this process leaves no
report (reward 0). The one line printed is ``<nonce> <json report>``, checked on the host.
Not prevented: test.sh judges the work dir, which the script controls by design (inputs
from ``environment/`` it rewrote, modules it planted where a ``python3 -c``/``-m`` run from
the work dir imports them); a program of the model that test.sh itself runs runs with the
verifier's powers and can write the reward file (same uid: a container with a separate
verifier user is needed for that).
"""

import base64
import contextlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import types

# harness_common.py from beside this file (hidden beside a hidden harness), read as source:
# never through sys.path (the work dir is the model's), never from a cached .pyc
_HERE, _NAME = os.path.split(os.path.abspath(__file__))
common = types.ModuleType("harness_common")
with open(os.path.join(_HERE, ("." if _NAME.startswith(".") else "") + "harness_common.py")) as _f:
    exec(compile(_f.read(), _f.name, "exec"), common.__dict__)
PATH = "/usr/local/bin:/usr/bin:/bin"


def run(argv, env, timeout_s, max_tail):
    """Run ``argv`` to its exit or ``timeout_s``, then kill all it left. Returns a dict:
    exit code (None at the deadline), timed_out, the tails of stdout and stderr."""
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True, close_fds=True,
                            env=env, cwd=os.getcwd())
    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    tails = list(bufs.values())
    timed_out, code, clean = common.watch(proc, bufs, dict.fromkeys(bufs, max_tail), timeout_s)
    return {"exit": None if timed_out else (code if code >= 0 else 128 - code),
            "timed_out": timed_out, "clean": clean,
            "stdout": tails[0][-max_tail:].decode("utf-8", "replace"),
            "stderr": tails[1][-max_tail:].decode("utf-8", "replace")}


def rewrite(text, paths):
    """Harbor's absolute paths (``/tests/...``, ``/logs/...``, ``/app``) to the staged ones;
    only where a path starts (not inside ``/usr/app`` or ``x/tests``)."""
    for old, new in paths.items():
        text = re.sub(r"(?<![\w./-])" + re.escape(old) + r"(?![\w.-])", lambda _m, n=new: n,
                      text)
    return text


def stage(files, root, paths):
    for rel, b64 in files.items():
        data = base64.b64decode(b64)
        with contextlib.suppress(UnicodeDecodeError):
            data = rewrite(data.decode("utf-8"), paths).encode("utf-8")
        target = os.path.join(root, rel)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "wb") as f:
            f.write(data)
        if rel.endswith(".sh"):
            os.chmod(target, 0o755)


def read_reward(logs):
    """The reward in ``logs/verifier``: reward.txt, else reward.json's ``reward``; None."""
    for name in ("reward.txt", "reward.json"):
        data = common.read_file(os.path.join(logs, "verifier", name), 4096)
        if data is None:
            continue
        text = data.decode("utf-8", "replace").strip()
        try:
            value = float(json.loads(text).get("reward")) if name.endswith(".json") \
                else float(text)
        except (ValueError, TypeError, AttributeError):
            return None
        return min(1.0, max(0.0, value)) if math.isfinite(value) else None
    return None


def trial(spec):
    work, tail = os.getcwd(), int(spec.get("max_tail", 2000))
    private = tempfile.mkdtemp(prefix="harness-")
    with open(os.path.join(private, "solve.sh"), "w") as f:
        f.write(rewrite(spec["script"], {spec["workdir"]: work}))
    env = {"PATH": PATH, "LANG": "C.UTF-8", "HOME": work}
    report = {"solution": run(["bash", os.path.join(private, "solve.sh")], env,
                              float(spec["solution_timeout_s"]), tail)}
    shutil.rmtree(private, ignore_errors=True)
    if not report["solution"]["clean"]:
        report["error"] = "the solution's processes could not all be killed"
        return report
    tests, logs, home = (tempfile.mkdtemp(prefix=p) for p in ("tests-", "logs-", "home-"))
    os.makedirs(os.path.join(logs, "verifier"))
    stage(spec["tests"], tests, {"/tests": tests, "/logs": logs, spec["workdir"]: work})
    env = {"PATH": PATH, "LANG": "C.UTF-8", "HOME": home, "PYTHONNOUSERSITE": "1",
           "PYTHONDONTWRITEBYTECODE": "1"}
    report["tests"] = run(["bash", os.path.join(tests, "test.sh")], env,
                          float(spec["test_timeout_s"]), tail)
    report["reward"] = read_reward(logs)
    return report


def main():
    spec = json.loads(sys.stdin.buffer.read())
    common.harden()
    try:
        report = trial(spec)
    except OSError as exc:  # the script filled /tmp, exhausted processes...
        report = {"error": f"{type(exc).__name__}: {exc}"}
    common.report(spec["nonce"], report)


if __name__ == "__main__":
    main()
