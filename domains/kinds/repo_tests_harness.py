"""The repo_tests kind's harness: runs INSIDE the sandbox, as ``python3 -I .repo_tests_harness.py``,
in the work dir that holds the repository as the model left it (its edits made with the
tools, or its diff applied by the host).

Input (stdin, read whole first): ``{"nonce", "restore": {path: base64}, "conftest":
"original" | "none", "tests": [pytest ids], "timeout_s", "max_message", "max_bytes",
"max_files"}``. ``restore`` is what the host decides the tests with: the hidden test files
and, for every file an id names and every ``conftest.py``, the original repository's
version.

The steps, in order:
1. every process this harness's parent left is not ours to see; every process below this
   one is killed (it is their subreaper) before and after the tests;
2. the work dir's regular files are copied into a fresh private directory with a random
   name under /tmp (links, fifos, ``.git``, caches and this harness left out): a process
   still writing into the work dir changes nothing the tests read;
3. in the copy, every ``conftest.py`` the model wrote is removed, then ``restore`` written
   over whatever is at those paths (a file, a directory, a link): the tests are the hidden
   ones, the conftests the original's (``conftest = "none"``: none, ``--noconftest``);
4. a canary test that must fail (``assert False``, a random name) is appended to every
   test file an id names;
5. pytest runs on exactly the ids and the canaries: ``python3 -I -m pytest -c <our ini>``
   (so no ``pytest.ini`` / ``tox.ini`` / ``setup.cfg`` / ``pyproject.toml`` of the repo is
   read: no ``addopts``, no plugins named there), ``--rootdir`` and ``--confcutdir`` the
   copy (no conftest.py above it, e.g. one planted in /tmp), ``-p no:cacheprovider``, with
   a clean environment (``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1``: no plugin from an entry
   point, such as a ``*.dist-info`` planted in the repo; no ``PYTEST_ADDOPTS`` /
   ``PYTEST_PLUGINS``; ``-I``: no ``PYTHONPATH``, user site or ``usercustomize``), the
   JUnit report at a fresh random path, until it exits or ``timeout_s``; everything it left
   is killed before the report is read (without following links);
6. one line is printed: ``<nonce> <json {"tests": [{name, status, message}], "canaries":
   [...], "exit", "output", "error"}>``; an id without a result is an ``error`` ("not
   run").

Why the result cannot be forged cheaply: the hidden tests and the nonce exist only in this
process's memory until step 3, and this process is non-dumpable; the tests, conftests and
pytest's configuration are the host's, whatever the repository holds; a module that exits
at import (``sys.exit``, ``os._exit``) leaves its tests without a pass; killing or stopping
this process leaves no report (reward 0); a blanket forgery (everything reported passed, by
a hook or by rewriting the report) also passes the canaries, which the host refuses.
Not prevented: the model's code runs inside the pytest process the tests import it into, so
code written to find the test ids at run time and rewrite pytest's own reporting for them
alone (and not the canaries) is not stopped; that needs the tests to call the code across a
process boundary.
"""

import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import types
import xml.etree.ElementTree as ET

# harness_common.py from beside this file (hidden beside a hidden harness), read as source:
# never through sys.path (the work dir is the model's), never from a cached .pyc
_HERE, _NAME = os.path.split(os.path.abspath(__file__))
common = types.ModuleType("harness_common")
with open(os.path.join(_HERE, ("." if _NAME.startswith(".") else "") + "harness_common.py")) as _f:
    exec(compile(_f.read(), _f.name, "exec"), common.__dict__)
PATH = "/usr/local/bin:/usr/bin:/bin"
SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", ".mypy_cache", ".hg", ".svn"}
HARNESS = os.path.basename(__file__)
COMMON = "." * HARNESS.startswith(".") + "harness_common.py"


class TooBig(Exception):
    pass


def copy_tree(src, dst, max_bytes, max_files):
    """The regular files under ``src`` into ``dst`` (no links followed or copied)."""
    total, count = 0, 0
    for root, dirs, files in os.walk(src, followlinks=False):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")
                   and not os.path.islink(os.path.join(root, d))]
        rel = os.path.relpath(root, src)
        for name in files:
            if (rel == "." and name in (HARNESS, COMMON)) or name.endswith((".pyc", ".pyo")):
                continue
            data = common.read_file(os.path.join(root, name), max_bytes - total + 1)
            if data is None:
                continue  # a link, a fifo, or gone
            total, count = total + len(data), count + 1
            if total > max_bytes or count > max_files:
                raise TooBig(f"the repository is over {max_bytes} bytes or {max_files} files")
            target = os.path.join(dst, rel, name)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "wb") as f:
                f.write(data)


def remove(path):
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)


def write_over(root, rel, data):
    """Write ``data`` at ``rel`` under ``root``, replacing whatever is there or on the way."""
    parts = rel.split("/")
    cur = root
    for part in parts[:-1]:
        cur = os.path.join(cur, part)
        if os.path.islink(cur) or (os.path.exists(cur) and not os.path.isdir(cur)):
            remove(cur)
        os.makedirs(cur, exist_ok=True)
    target = os.path.join(cur, parts[-1])
    remove(target)
    with open(target, "wb") as f:
        f.write(data)


def prepare(repo, spec, canary):
    """Steps 3 and 4: conftests, the restored files, the canaries; their ids."""
    for root, _dirs, files in os.walk(repo):
        if "conftest.py" in files:
            os.unlink(os.path.join(root, "conftest.py"))
    restore = {rel: base64.b64decode(b64) for rel, b64 in spec["restore"].items()}
    for rel, data in sorted(restore.items()):
        if spec.get("conftest") == "none" and rel.rsplit("/", 1)[-1] == "conftest.py":
            continue
        write_over(repo, rel, data)
    canaries = []
    for rel in sorted({t.split("::", 1)[0] for t in spec["tests"]}):
        path = os.path.join(repo, rel)
        if os.path.isfile(path):
            with open(path, "ab") as f:
                f.write(f"\n\ndef {canary}():\n    assert False, 'canary'\n".encode())
            canaries.append(f"{rel}::{canary}")
    return canaries


def run(argv, env, cwd, timeout_s, max_tail):
    """Run to exit or ``timeout_s``, then kill all it left: (exit or None, output tail)."""
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
                            env=env, cwd=cwd)
    fd, tail = proc.stdout.fileno(), bytearray()
    timed_out, code, _ = common.watch(proc, {fd: tail}, {fd: max_tail}, timeout_s,
                                      poll_s=0.05, wait_s=0.5)
    return (None if timed_out else code), tail[-max_tail:].decode("utf-8", "replace")


def node_id(file, classname, name):
    module = file[:-3].replace("/", ".") if file.endswith(".py") else file
    if name == module:  # a collection error: the file itself
        return file
    cls = classname[len(module) + 1:] if classname.startswith(module + ".") else ""
    return "::".join(p for p in (file, *cls.split("."), name) if p)


def read_report(path, limit):
    """{node id: (status, message)} of the JUnit report at ``path`` (no links followed)."""
    data = common.read_file(path, 64 << 20)
    if data is None:
        return {}
    try:
        root = ET.fromstring(data)
    except (ET.ParseError, ValueError):
        return {}
    out = {}
    for case in root.iter("testcase"):
        status, message = "pass", ""
        for child, kind in (("failure", "fail"), ("error", "error"), ("skipped", "skip")):
            found = case.find(child)
            if found is not None:
                status = kind
                message = ((found.get("message") or "") + "\n" + (found.text or "")).strip()
                break
        key = node_id(case.get("file") or "", case.get("classname") or "", case.get("name", ""))
        if out.get(key, ("pass",))[0] == "pass":  # a teardown error after a pass wins
            out[key] = (status, message[-limit:])
    return out


def check(spec):
    limit, tail = int(spec.get("max_message", 500)), 4000
    private = tempfile.mkdtemp(prefix="repo-check-")
    repo, home = os.path.join(private, "repo"), os.path.join(private, "home")
    os.makedirs(repo)
    os.makedirs(home)
    copy_tree(os.getcwd(), repo, int(spec["max_bytes"]), int(spec["max_files"]))
    canaries = prepare(repo, spec, common.fresh_name("test_", nbytes=8))
    ini = os.path.join(private, common.fresh_name("pytest-", ".ini", nbytes=8))
    with open(ini, "w") as f:
        f.write(f"[pytest]\npythonpath = {repo}\naddopts =\n")
    report = os.path.join(private, common.fresh_name("report-", ".xml"))
    argv = [sys.executable, "-I", "-m", "pytest", "-c", ini, "--rootdir", repo,
            "--confcutdir", repo, "-p", "no:cacheprovider", "-o", "junit_family=xunit1",
            "-o", "console_output_style=classic", "--continue-on-collection-errors",
            f"--junitxml={report}", "-q"]
    if spec.get("conftest") == "none":
        argv.append("--noconftest")
    env = {"PATH": PATH, "LANG": "C.UTF-8", "HOME": home, "PYTHONDONTWRITEBYTECODE": "1",
           "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    code, output = run(argv + list(spec["tests"]) + canaries, env, repo,
                       float(spec["timeout_s"]), tail)
    found = read_report(report, limit)
    shutil.rmtree(private, ignore_errors=True)

    def result(test_id):
        status, message = found.get(test_id, ("error", ""))
        if test_id not in found:
            message = "not run" + (" (timed out)" if code is None else "")
            file = test_id.split("::", 1)[0]
            if file in found:  # the file did not import
                message = "not run: " + found[file][1]
        return {"name": test_id, "status": status, "message": message}

    return {"tests": [result(t) for t in spec["tests"]],
            "canaries": [result(t) for t in canaries],
            "exit": code, "output": output[-tail:]}


def main():
    spec = json.loads(sys.stdin.buffer.read())
    common.harden()
    common.kill_descendants()
    try:
        report = check(spec)
    except (OSError, TooBig) as exc:  # the repo filled /tmp, is too big...
        report = {"error": f"{type(exc).__name__}: {exc}"}
    common.report(spec["nonce"], report)


if __name__ == "__main__":
    main()
