#!/usr/bin/env bash
# The wheels check.sh installs where python3 lacks the project's pure-Python dependencies: the
# lent GPU machine (Python 3.12, x86-64, torch and transformers but no trio, msgspec, structlog,
# hypercorn or starlette) cannot download them. Run here, where pip can: it fetches the versions
# of the repo's .venv, for that Python, into .cache/gpu-wheels (ignored by git), about 1.2 MB.
# Then carry that folder with the working tree and run check.sh there.
#   bash benchmarks/gpu/wheels.sh [PYTHON_VERSION]     # default 3.12
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-.venv/bin/python}"
OUT="${WHEELS:-.cache/gpu-wheels}"
# What parts generation and weight_sync import beyond that machine's packages
NAMES="trio outcome sniffio msgspec structlog hypercorn h2 hpack hyperframe priority wsproto starlette"
SPECS=$("$PY" -c 'import sys, importlib.metadata as m; print(" ".join(f"{n}=={m.version(n)}" for n in sys.argv[1:]))' $NAMES)
mkdir -p "$OUT"
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "${1:-3.12}" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$OUT" $SPECS
ls "$OUT"
