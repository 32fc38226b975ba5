#!/usr/bin/env bash
# Learner step time, tokens/s and weight save/load time for a 0.5B-class model in bf16 on one
# GPU (no internet, no SGLang: python + torch + transformers). Prints one JSON object.
#   bash benchmarks/gpu/check.sh              # GPU (a few minutes; hard limit 8 minutes)
#   bash benchmarks/gpu/check.sh --cpu --tiny # CPU smoke run
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
exec timeout 470 "$PY" benchmarks/gpu/check.py "$@"
