"""The cad domain's driver: runs INSIDE the sandbox, as ``python3 -I -S cad_driver.py``.

Its input (stdin, read whole before anything else runs): ``{"nonce", "source", "runtime",
"checker", "script_timeout_s", "check_timeout_s", "max_mesh_bytes"}``.

1. The model's script runs as a child (``python3 -I -S``, its own session, cwd ``model/``,
   stdin /dev/null, stdout and stderr kept to their last 2 KB for diagnostics only), with
   the CAD runtime (``runtime``: numpy, manifold3d, trimesh) on its path. It must leave
   ``out.npz`` (``vertices`` (n, 3) floats, ``faces`` (m, 3) ints) or ``out.stl`` in
   ``model/``, or a manifold3d object in a global ``shape``, which is then saved to
   ``out.npz`` in the same child (what the script left is data either way: only the
   checker measures it).
2. When it exits (or its deadline passes) its process group is SIGKILLed, and then every
   process it left behind: this process is a child subreaper, so a daemonised grandchild is
   re-parented here and killed too. From then on nothing the model started is alive.
3. Only then is the checker staged: its source (from this process's memory, never a file
   the model could reach) and a copy of the mesh file (a regular file, no link followed, at
   most ``max_mesh_bytes``) go into a fresh directory, and ``python3 -I -S checker.py`` runs
   there. Its JSON measurements are checked for shape here, and this process prints the one
   line ``<nonce> <json>``; the host validates it again and compares with the task.

A verdict with ``"unjudged": <why>`` says the check itself failed (no CAD runtime marker,
the checker exited non-zero by itself or printed no verdict): the host raises
VerifierFailed on it. A checker killed by a signal or past its deadline was measuring the
model's mesh: a plain ``built: false``.

Why the model cannot forge a verdict: it never learns the nonce (stdin is consumed before it
starts; this process is non-dumpable, so /proc/<pid>/fd and memory are closed to it), its own
output goes nowhere the host reads, and it is dead before the checker exists. With ``-I``
neither the script's directory nor ``PYTHON*`` variables reach ``sys.path``, so a planted
``numpy.py`` or ``trimesh/`` in the work dir is never imported by the checker.
"""

import contextlib
import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time

PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
STDERR_KEEP = 2048
RUNTIME_MARKER = "streamrl-cad.json"  # runtime.MARKER: installed by runtime.install
RUN_MODEL = (
    "import os, runpy, sys\n"
    "sys.path.insert(0, sys.argv[1])\n"
    "sys.argv = ['main.py']\n"
    "g = runpy.run_path('main.py', run_name='__main__')\n"
    "shape = g.get('shape')\n"
    "if not os.path.exists('out.npz') and not os.path.exists('out.stl') and shape is not None:\n"
    "    import numpy as np\n"
    "    m = shape.to_mesh()\n"
    "    np.savez('out.npz', vertices=m.vert_properties[:, :3], faces=m.tri_verts)\n"
)
ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "OPENBLAS_NUM_THREADS": "1",
       "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}


def prctl(option, value):
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(option, value, 0, 0, 0)


def drain(proc, deadline, keep, cap):
    """Read ``proc.stdout`` until EOF or the deadline; keep the first or last ``keep`` bytes
    (``cap`` set: the first ``cap``, then None for over the cap). Returns (data, finished)."""
    data = b""
    fd = proc.stdout.fileno()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return data, False
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            return data, False
        chunk = os.read(fd, 65536)
        if not chunk:
            return data, True
        data += chunk
        if cap is not None and len(data) > cap:
            return None, False
        if keep is not None:
            data = data[-keep:]


def children_of(pid):
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 1 and int(fields[1]) == pid:
            found.append(int(entry))
    return found


def kill_everything_left(pgid, deadline_s=5.0):
    """SIGKILL the model's process group, then every descendant re-parented to us."""
    with contextlib.suppress(OSError):
        os.killpg(pgid, signal.SIGKILL)
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        for pid in children_of(os.getpid()):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return True  # no child left at all
        if pid == 0:
            time.sleep(0.01)
    return False


def read_mesh(model_dir, max_bytes):
    """(name, bytes) of the model's mesh file, or (None, why)."""
    for name in ("out.npz", "out.stl"):
        try:
            fd = os.open(os.path.join(model_dir, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        st = os.fstat(fd)
        if st.st_mode & 0o170000 != 0o100000:  # a directory, a fifo: the model's doing
            os.close(fd)
            return None, f"{name} is not a regular file"
        with os.fdopen(fd, "rb") as f:
            if st.st_size > max_bytes:
                return None, f"{name} is larger than {max_bytes} bytes"
            return name, f.read(max_bytes + 1)[:max_bytes]
    return None, "no out.npz or out.stl written"


def run_model(spec, work):
    model_dir = os.path.join(work, "model")
    os.mkdir(model_dir, 0o700)
    with open(os.path.join(model_dir, "main.py"), "w") as f:
        f.write(spec["source"])
    proc = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", RUN_MODEL, spec["runtime"]],
        cwd=model_dir, env={**ENV, "HOME": model_dir}, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
    )
    deadline = time.monotonic() + spec["script_timeout_s"]
    tail, _ = drain(proc, deadline, STDERR_KEEP, None)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    timed_out = proc.poll() is None
    if not kill_everything_left(proc.pid):
        return None, {"built": False, "error": "could not end the model's processes"}
    code = proc.returncode if proc.returncode is not None else -9
    info = {"exit_code": code, "timed_out": timed_out,
            "stderr_tail": tail.decode("utf-8", "replace")[-500:]}
    if timed_out:
        return None, {"built": False, "error": "script timed out", **info}
    name, mesh = read_mesh(model_dir, spec["max_mesh_bytes"])
    if name is None:
        return None, {"built": False, "error": mesh, **info}
    return (name, mesh), info


def unjudged(why):
    """The verdict when the check itself failed (the host raises VerifierFailed on it)."""
    return {"built": False, "error": why, "unjudged": why}


def run_checker(spec, name, mesh):
    try:  # the model's files may have filled the disk: that is its doing, a plain 0
        fresh = tempfile.mkdtemp(prefix="check-")
        with open(os.path.join(fresh, "checker.py"), "w") as f:
            f.write(spec["checker"])
        with open(os.path.join(fresh, name), "wb") as f:
            f.write(mesh)
        errors = open(os.path.join(fresh, "checker.err"), "w+b")  # noqa: SIM115
    except OSError as exc:
        return {"built": False, "error": f"cannot stage the checker: {exc}"[:300]}
    proc = subprocess.Popen(
        [sys.executable, "-I", "-S", "checker.py", spec["runtime"], name],
        cwd=fresh, env={**ENV, "HOME": fresh}, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=errors, start_new_session=True, close_fds=True,
    )
    deadline = time.monotonic() + spec["check_timeout_s"]
    raw, finished = drain(proc, deadline, None, 65536)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    kill_everything_left(proc.pid)
    errors.seek(0)
    stderr = errors.read()[-4096:].decode("utf-8", "replace")
    errors.close()
    if raw is None or not finished or proc.returncode is None or proc.returncode < 0:
        # past its deadline, or killed (out of memory): measuring the model's mesh did it
        return {"built": False, "error": f"checker failed (exit {proc.returncode})"}
    if proc.returncode != 0:  # it raised: the checker's own failure (it never sees the task)
        lines = [x for x in stderr.splitlines() if x.strip()]
        return unjudged(f"the checker failed (exit {proc.returncode}): "
                        + (lines[-1][:300] if lines else "no output"))
    try:
        verdict = json.loads(raw)
    except ValueError:
        return unjudged("the checker's output is not JSON")
    if type(verdict) is not dict or type(verdict.get("built")) is not bool:
        return unjudged("the checker's output has no verdict")
    return verdict


def main():
    spec = json.loads(sys.stdin.buffer.read())
    prctl(PR_SET_DUMPABLE, 0)
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    if not os.path.exists(os.path.join(spec["runtime"], RUNTIME_MARKER)):
        verdict = unjudged(f"the CAD runtime is missing: no {spec['runtime']}/{RUNTIME_MARKER}")
        sys.stdout.write(spec["nonce"] + " " + json.dumps(verdict) + "\n")
        return
    mesh, info = run_model(spec, os.getcwd())
    verdict = info if mesh is None else {**run_checker(spec, *mesh), "exit_code": info["exit_code"]}
    sys.stdout.write(spec["nonce"] + " " + json.dumps(verdict, allow_nan=False) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
