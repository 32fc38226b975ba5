#!/usr/bin/env bash
# GPU readiness: the learner's FSDP2 step (tokens/s, MFU), the in-process engine's generation
# and weight sync to a serve-model, for a Qwen2-0.5B-shaped model (no internet, no SGLang).
# Prints one JSON object; each part has its own time budget (benchmarks/gpu/check.py).
#   bash benchmarks/gpu/check.sh              # GPU (under 10 minutes; hard limit 580 s)
#   bash benchmarks/gpu/check.sh --cpu --tiny # CPU smoke run
# Python: $PYTHON, else the repo's .venv, else python3 (the project need not be installed).
# Where it lacks the project's other dependencies (the lent GPU has torch and transformers,
# not trio or msgspec: the learner part runs, the other two report an ImportError), carry
# their wheels in .cache/gpu-wheels/ (benchmarks/gpu/wheels.sh, run where pip can download)
# or a folder named in $WHEELS: they are installed into a temporary folder on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
WHEELS="${WHEELS:-.cache/gpu-wheels}"
if ! "$PY" -c 'import trio, msgspec, structlog, hypercorn, starlette' 2>/dev/null \
    && compgen -G "$WHEELS/*.whl" >/dev/null; then
  SITE="$(mktemp -d)"
  trap 'rm -rf "$SITE"' EXIT
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
timeout 580 "$PY" benchmarks/gpu/check.py "$@"
