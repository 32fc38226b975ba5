"""GPU readiness in one run: the learner's FSDP2 step, the in-process engine's generation and
weight sync to a serve-model, on a Qwen2-0.5B-shaped model built from a config (random
weights: nothing is downloaded). Prints one JSON object.

Parts (``--parts``, all by default), each its own module here:

- ``learner`` (:mod:`part_learner`): :meth:`learner.train.Trainer.step_batch` under FSDP2
  (bf16 parameters, fp32 reduction) and, side by side, without it; tokens/s and MFU;
- ``generation`` (:mod:`part_generation`): the generator's in-process transformers engine;
  generated tokens/s and completions/s per batch size;
- ``weight_sync`` (:mod:`part_weight_sync`): the learner's snapshot to a serve-model server
  over the broadcast group and through disk, timed, and checked served.

Each part runs in a child process of its own with a time budget (``--budget PART=SECONDS``;
the defaults keep the whole under 10 minutes on one H200): a part that raises, crashes or runs
out of time is reported as ``{"error": ...}`` with the figures it wrote before, and the next
part runs. The child writes its figures to a file as it measures them.

Simplifications: one device (or torchrun's ranks for the learner part: run
``torchrun --nproc-per-node N benchmarks/gpu/check.py --child learner --result F``); random
weights and synthetic batches (the speed does not depend on the values); the engine and the
server decode on the CPU, as they always do (GPUs serve through SGLang, not started here).

    bash benchmarks/gpu/check.sh                          # GPU, 0.5B (under 10 minutes)
    bash benchmarks/gpu/check.sh --cpu --tiny             # CPU smoke run (seconds)
    bash benchmarks/gpu/check.sh --parts learner --budget learner=300
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PARTS = ("learner", "generation", "weight_sync")
BUDGET_S = {"learner": 210, "generation": 150, "weight_sync": 180}
"""Seconds per part on the GPU (540 in all; ``check.sh`` stops everything at 580)."""


def importable_checkout() -> None:
    """``streamrl.<folder>`` from this checkout, installed or not: on a machine where the
    project is not installed (the lent GPU: python with torch and transformers), the folders
    beside ``streamrl/`` become its subpackages, as ``pyproject.toml``'s package-dir maps them."""
    import importlib.util

    sys.path.insert(0, str(ROOT))
    import streamrl

    if importlib.util.find_spec("streamrl.learner") is None:
        streamrl.__path__.append(str(ROOT))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu", action="store_true", help="run on the CPU (smoke test)")
    p.add_argument("--tiny", action="store_true", help="a tiny config instead of 0.5B")
    p.add_argument("--parts", default=",".join(PARTS), help="comma-separated, of " + str(PARTS))
    p.add_argument("--budget", action="append", default=[], metavar="PART=SECONDS",
                   help="a part's time budget (repeatable); defaults " + str(BUDGET_S))
    learner = p.add_argument_group("learner")
    learner.add_argument("--samples", type=int, default=64)
    learner.add_argument("--prompt-len", type=int, default=256)
    learner.add_argument("--completion-len", type=int, default=768)
    learner.add_argument("--micro-batch-size", type=int, default=8)
    learner.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up")
    learner.add_argument("--grad-checkpointing", action="store_true")
    learner.add_argument("--peak-tflops", type=float, default=None,
                         help="the device's dense bf16 peak (default: from a table by name)")
    gen = p.add_argument_group("generation")
    gen.add_argument("--gen-batches", default="1,16", help="batch sizes, comma-separated")
    gen.add_argument("--gen-prompt-len", type=int, default=128)
    gen.add_argument("--gen-new-tokens", type=int, default=64)
    sync = p.add_argument_group("weight_sync")
    sync.add_argument("--bucket-mb", type=int, default=512,
                      help="broadcast bucket size (learner.broadcast_bucket_mb)")
    p.add_argument("--child", choices=PARTS, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    return p


def budgets(args: argparse.Namespace) -> dict[str, float]:
    out: dict[str, float] = dict(BUDGET_S)
    for item in args.budget:
        name, _, seconds = item.partition("=")
        if name not in PARTS:
            raise SystemExit(f"--budget {item}: unknown part {name!r}")
        out[name] = float(seconds)
    return out


def run_child(args: argparse.Namespace) -> None:
    """In the child: run one part; an exception becomes the part's ``error``."""
    importable_checkout()
    sys.path.insert(0, str(HERE))
    from common import Report

    report = Report(args.result)
    try:
        if args.child == "learner":
            from part_learner import run
        elif args.child == "generation":
            from part_generation import run
        else:
            from part_weight_sync import run
        run(args, report)
    except Exception as exc:  # the part's failure is one of its figures
        traceback.print_exc()
        report.update(error=f"{type(exc).__name__}: {exc}"[:2000])


def run_part(name: str, budget: float) -> dict[str, Any]:
    """One part in a child process of this script, stopped after ``budget`` seconds."""
    with tempfile.TemporaryDirectory(prefix=f"gpu-check-{name}-") as tmp:
        result, log = Path(tmp) / "result.json", Path(tmp) / "log"
        command = [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:],
                   "--child", name, "--result", str(result)]  # fmt: skip
        started = time.perf_counter()
        error = None
        with log.open("wb") as out:
            try:
                code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT,
                                      timeout=budget).returncode  # fmt: skip
                if code != 0:
                    error = f"exit status {code}: {log.read_text(errors='replace')[-1500:]}"
            except subprocess.TimeoutExpired:
                error = f"stopped after its budget of {budget:g} s"
        figures: dict[str, Any] = json.loads(result.read_text()) if result.exists() else {}
    if error is not None and "error" not in figures:
        figures["error"] = error
    figures["seconds"] = round(time.perf_counter() - started, 1)
    return figures


def main() -> None:
    args = parser().parse_args()
    if args.child:
        return run_child(args)
    import torch

    sys.path.insert(0, str(HERE))
    from common import model_name

    if not args.cpu and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: pass --cpu (with --tiny) for a CPU smoke run")
    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise SystemExit(f"--parts: unknown {sorted(unknown)}; choose from {PARTS}")
    limits = budgets(args)
    started = time.perf_counter()
    out: dict[str, Any] = {
        "benchmark": "gpu_check",
        "device": torch.cuda.get_device_name() if not args.cpu
        else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "model": model_name(args.tiny),
        "parts": parts,
        "budgets_s": {p: limits[p] for p in parts},
    }
    for part in parts:
        out[part] = run_part(part, limits[part])
    out["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
