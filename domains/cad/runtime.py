"""The CAD runtime: numpy, manifold3d and trimesh for the sandbox's own ``python3``.

The process sandbox (bwrap) shows the code only /usr, /bin, /lib* and its work dir, and runs
``/usr/bin/python3`` with a scrubbed environment, so the host's virtualenv is out of reach.
The cad domain's scripts and checker import their libraries from one directory under /usr
instead, installed with ``pip install --target`` for that interpreter's version (binary
wheels only, nothing compiled)::

    .venv/bin/python -m streamrl.domains.cad.runtime [--target /usr/local/lib/streamrl-cad]
        [--check]

``$STREAMRL_CAD_RUNTIME`` overrides the directory (it must be visible inside the sandbox:
anywhere under /usr for bwrap). A container image for the cad domain needs the same three
packages importable by its ``python3`` from that path (docs/domains.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

DEFAULT_DIR = "/usr/local/lib/streamrl-cad"
PACKAGES = {"numpy": "2.4.6", "manifold3d": "3.5.4", "trimesh": "5.2.0"}
SANDBOX_PYTHON = "/usr/bin/python3"
MARKER = "streamrl-cad.json"


def runtime_dir() -> Path:
    return Path(os.environ.get("STREAMRL_CAD_RUNTIME") or DEFAULT_DIR)


def python_version(python: str = SANDBOX_PYTHON) -> str:
    out = subprocess.run(
        [python, "-I", "-S", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
        capture_output=True, text=True, check=True, timeout=30,
    )  # fmt: skip
    return out.stdout.strip()


def is_installed(target: Path | None = None, python: str = SANDBOX_PYTHON) -> bool:
    """The runtime at ``target`` was installed for this interpreter with these versions."""
    target = target or runtime_dir()
    try:
        marker = json.loads((target / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return bool(marker == {"python": python_version(python), "packages": PACKAGES})


def install(target: Path | None = None, python: str = SANDBOX_PYTHON) -> Path:
    """Install the runtime (idempotent: a matching marker file means done)."""
    target = target or runtime_dir()
    if is_installed(target, python):
        return target
    version = python_version(python)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
         "--upgrade", "--target", str(target), "--only-binary=:all:", "--no-compile",
         "--python-version", version, *(f"{k}=={v}" for k, v in PACKAGES.items())],
        check=True, timeout=600,
    )  # fmt: skip
    os.chmod(target, 0o755)
    (target / MARKER).write_text(json.dumps({"python": version, "packages": PACKAGES}))
    return target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--target", default=None,
                    help=f"default: $STREAMRL_CAD_RUNTIME or {DEFAULT_DIR}")
    ap.add_argument("--check", action="store_true", help="only say whether it is installed")
    args = ap.parse_args()
    target = Path(args.target) if args.target else runtime_dir()
    if args.check:
        ok = is_installed(target)
        print(f"{target}: {'installed' if ok else 'missing'}")
        sys.exit(0 if ok else 1)
    print(install(target))


if __name__ == "__main__":
    main()
