"""Claim: where decoding shares the CPUs with the learner (``streamrl up`` on one machine),
running the decoding processes at a lower priority (``up.decode_nice``) brings the learner's
step back toward its time alone, while the decoders still produce more rows than the learner
trains on. Baseline: the same decoders at niceness 0 (what ``up`` did before), in the same run.

Arms, alternating each repeat, each in fresh processes:
- ``alone``: the learner step with nothing else running;
- ``nice0``: beside ``--decoders`` decoding loops at niceness 0;
- ``nice``: beside the same loops at niceness ``--nice``.

Every process starts in a session of its own, as ``streamrl up`` starts its children, and a
niced decoder's session gets the nice value too (runtime/priority.py: with the kernel's
session autogroups a process's own nice value weighs only within its session).

Learner: ``benchmarks/learner_step.py --only shared`` with the demo's step (``--groups`` 4 of
8 samples, 51 prompt + 32 completion tokens, 1 torch thread). Decoders: each a process holding
the policy in ``--dtype`` (``auto``: bf16 where the CPU has bf16 hardware), 1 torch thread,
decoding the demo's generator batch (6 groups of 8 ``arith`` prompts at T=0.7, 64 new tokens)
again and again; they count rows finished while the learner process runs (model load and
warm-up step included).

Prints one JSON object: per arm the median step seconds and the decoders' rows per second;
``nice_speedup`` (nice0's step over nice's), ``nice_over_alone`` (nice's step over alone's),
and per decoding arm ``rows_per_step`` (rows decoded in one learner step; a step trains on
``groups * group_size``).

    .venv/bin/python benchmarks/learner_priority.py --json
    .venv/bin/python benchmarks/learner_priority.py --json --model tiny --steps 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
HERE = Path(__file__).resolve().parent


def decode_loop(args: argparse.Namespace) -> None:
    """A decoder: write one line per finished batch (``<unix time> <rows>``) until killed."""
    import torch

    from streamrl.domains.registry import get_domain
    from streamrl.inference import decode
    from streamrl.inference.transformers_engine import serving_dtype
    from streamrl.models import load_model, load_tokenizer, resolve_model

    torch.set_num_threads(1)
    model_dir = resolve_model(args.model)
    tokenizer = load_tokenizer(model_dir)
    model = load_model(model_dir, dtype=serving_dtype(args.dtype)).eval()
    vocab = model.config.vocab_size
    arith = get_domain("arith")
    prompts = [[t % vocab for t in arith.render_prompt(item, tokenizer)]
               for item in arith.load_items("eval")[:6]]
    seqs = [p for p in prompts for _ in range(8)]
    out = Path(args.decode_loop)
    seed = 0
    while True:
        rows = [decode.Row(prompt=s, max_new_tokens=64, temperature=0.7,
                           generator=torch.Generator().manual_seed(seed + i))
                for i, s in enumerate(seqs)]
        seed += len(rows)
        with torch.inference_mode():
            decode.decode_batch(model, rows, frozenset(), 0)
        with out.open("a") as f:
            f.write(f"{time.time()} {len(rows)}\n")


def learner_step(args: argparse.Namespace) -> tuple[list[float], float, float]:
    """The learner's step times, and when its process started and ended (unix time)."""
    started = time.time()
    child = subprocess.run(  # in a session of its own, as `up` starts the learner
        [sys.executable, str(HERE / "learner_step.py"), "--only", "shared",
         "--model", args.model, "--groups", str(args.groups), "--group-size", "8",
         "--prompt-len", "51", "--completion-len", "32", "--threads", "1",
         "--steps", str(args.steps)],
        check=True, capture_output=True, text=True, start_new_session=True,
    )  # fmt: skip
    ended = time.time()
    return json.loads(child.stdout.strip().splitlines()[-1])["step_seconds"], started, ended


def run_arm(args: argparse.Namespace, nice: int | None, tmp: Path) -> dict[str, Any]:
    """One arm: ``nice`` None runs the learner alone, else beside decoders at that niceness."""
    from streamrl.runtime.priority import lower_priority, niced

    decoders, logs = [], []
    try:
        for i in range(args.decoders if nice is not None else 0):
            log = tmp / f"decoder-{nice}-{i}-{time.monotonic_ns()}.txt"
            logs.append(log)
            decoder = subprocess.Popen(  # as `up` starts a generator (cli/up.py)
                niced([sys.executable, __file__, "--decode-loop", str(log), "--model",
                       args.model, "--dtype", args.dtype], nice),
                start_new_session=True,
            )  # fmt: skip
            lower_priority(decoder.pid, nice)
            decoders.append(decoder)
        deadline = time.monotonic() + 600
        while not all(log.exists() for log in logs):  # every decoder has finished a batch
            if any(d.poll() is not None for d in decoders):
                raise RuntimeError("a decoder exited before its first batch")
            if time.monotonic() > deadline:
                raise RuntimeError("the decoders did not warm up in 600 s")
            time.sleep(0.5)
        steps, started, ended = learner_step(args)
    finally:
        for d in decoders:
            d.kill()
            d.wait()
    rows = 0
    for log in logs:
        for line in log.read_text().splitlines():
            at, n = line.split()
            rows += int(n) if started <= float(at) <= ended else 0
    rows_per_s = rows / (ended - started)
    return {"step_seconds": [round(s, 3) for s in steps],
            "decode_rows_per_s": round(rows_per_s, 3) if nice is not None else None,
            "learner_process_s": round(ended - started, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto", help="the decoders' (generator.dtype)")
    ap.add_argument("--decoders", type=int, default=2, help="decoding processes (up.generators)")
    ap.add_argument("--nice", type=int, default=10, help="the decoders' niceness in the nice arm")
    ap.add_argument("--groups", type=int, default=4, help="groups of 8 per learner step")
    ap.add_argument("--steps", type=int, default=2, help="timed learner steps per arm")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="JSON only (the default prints it too)")
    ap.add_argument("--decode-loop", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.decode_loop:
        decode_loop(args)
        return

    import tempfile

    import torch

    from streamrl.inference.transformers_engine import native_bf16, serving_dtype
    from streamrl.runtime.priority import autogroups_enabled

    arms: dict[str, int | None] = {"alone": None, "nice0": 0, "nice": args.nice}
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):
            for arm, nice in arms.items():
                runs[arm].append(run_arm(args, nice, Path(tmp)))
    summary: dict[str, dict[str, Any]] = {}
    for arm, results in runs.items():
        steps = [s for r in results for s in r["step_seconds"]]
        rates = [r["decode_rows_per_s"] for r in results if r["decode_rows_per_s"] is not None]
        step = statistics.median(steps)
        rate = statistics.median(rates) if rates else None
        summary[arm] = {
            "step_seconds_median": round(step, 3), "decode_rows_per_s": rate,
            "rows_per_step": round(rate * step, 1) if rate is not None else None,
            "runs": results,
        }
    alone, nice0, nice = (summary[a]["step_seconds_median"] for a in arms)
    out = {
        "benchmark": "learner_priority", "model": args.model, "decoders": args.decoders,
        "nice": args.nice, "decoder_dtype": str(serving_dtype(args.dtype)).removeprefix("torch."),
        "native_bf16": native_bf16(), "groups": args.groups, "rows_per_step_trained":
        args.groups * 8, "steps": args.steps, "repeats": args.repeats, "cpus": os.cpu_count(),
        "machine": platform.machine(), "torch": torch.__version__,
        "autogroups": autogroups_enabled(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "arms": summary,
        "nice_speedup": round(nice0 / nice, 3),
        "nice_over_alone": round(nice / alone, 3),
        "nice0_over_alone": round(nice0 / alone, 3),
    }
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
