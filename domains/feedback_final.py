"""``code`` with feedback: the final check's launcher, runs INSIDE the sandbox session as
``python3 -I feedback_final.py`` once a member's episode ended.

Input (stdin, read whole first): ``{"harness", "key", "file", "spec"}``. It reads the last
program the model submitted (``file``, staged in the session by every turn's run), puts it
into the harness's input as ``spec[key]`` and runs ``python3 -I <harness>`` on it, relaying
its stdout (capped) and exit code. The harness keeps its own guarantees (the program never
runs in the harness's process; its one line carries a nonce only the host knows); this
process, which holds the nonce too, marks itself non-dumpable like the harnesses, and every
process the model's earlier turns started was killed before it runs (sessions keep files,
not processes). No program staged (the model never wrote code): nothing is run, exit 1.
"""

import contextlib
import ctypes
import json
import os
import subprocess
import sys

MAX_STDOUT = 4 << 20


def main():
    job = json.loads(sys.stdin.buffer.read())
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 0
    if not os.path.isfile(job["file"]):
        sys.exit(1)
    with open(job["file"], encoding="utf-8", errors="replace") as f:
        job["spec"][job["key"]] = f.read()
    proc = subprocess.run([sys.executable, "-I", job["harness"]],
                          input=json.dumps(job["spec"]).encode(), stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, check=False)
    sys.stdout.buffer.write(proc.stdout[:MAX_STDOUT])
    sys.stdout.flush()
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
