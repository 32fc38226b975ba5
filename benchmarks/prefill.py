"""Claim: the in-process engine's prefill (:func:`streamrl.inference.decode._prefill`) costs a
batch's distinct prompt tokens, not rows x longest prompt: a GRPO group's samples share one
prefill, and prompts of different lengths are prefilled in buckets of similar length. Baseline,
in the same process on the same prompts: the plain left-padded prefill of every row
(``decode._forward``, what the engine did before). Both give the same logits (the largest
difference is reported).

Workloads (random token ids, fixed seed):
- ``groups``: ``--groups`` groups of ``--group-size`` identical prompts (a training batch);
- ``distinct``: ``--distinct`` different prompts (a held-out round: one sample per item);
- ``demo``: 6 groups of 8 prompts of 70-90 tokens (configs/demo.toml's batch).
Prompt lengths of ``groups`` and ``distinct`` are log-normal with the median (238 tokens) and
mean (307) of the SmolLM2 chat prompts of configs/gym.toml's held-out items, capped at
``--max-len`` (the longest was 2,316). Each figure is the median of ``--repeats`` timed runs
after one warm-up. Prints one JSON object.

    .venv/bin/python benchmarks/prefill.py --json                 # smollm2-135m, one thread
    .venv/bin/python benchmarks/prefill.py --json --model tiny --repeats 1
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MEDIAN, MEAN = 238, 307


def lengths(n: int, rng: random.Random, cap: int) -> list[int]:
    mu = math.log(MEDIAN)
    sigma = math.sqrt(2 * math.log(MEAN / MEDIAN))
    return [max(8, min(cap, round(rng.lognormvariate(mu, sigma)))) for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the engine's own)")
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--distinct", type=int, default=12)
    ap.add_argument("--max-len", type=int, default=1500)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="JSON only (the default prints it too)")
    args = ap.parse_args()

    import torch

    from streamrl.inference import decode
    from streamrl.models import load_model, resolve_model

    torch.set_num_threads(args.threads)
    model = load_model(resolve_model(args.model)).eval()
    vocab = model.config.vocab_size
    rng = random.Random(args.seed)
    cap = min(args.max_len, model.config.max_position_embeddings - 1)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    group_prompts = [prompt(n) for n in lengths(args.groups, rng, cap)]
    workloads = {
        "groups": [p for p in group_prompts for _ in range(args.group_size)],
        "distinct": [prompt(n) for n in lengths(args.distinct, rng, cap)],
        "demo": [p for p in (prompt(rng.randint(70, 90)) for _ in range(6)) for _ in range(8)],
    }

    def plain(seqs: list[list[int]]) -> torch.Tensor:
        return decode._forward(model, seqs, 0)[0]

    def shared(seqs: list[list[int]]) -> torch.Tensor:
        return decode._prefill(model, seqs, 0)[0]

    def timed(fn: Any, seqs: list[list[int]]) -> tuple[float, torch.Tensor]:
        with torch.inference_mode():
            fn(seqs)  # warm-up
            times, out = [], None
            for _ in range(args.repeats):
                start = time.perf_counter()
                out = fn(seqs)
                times.append(time.perf_counter() - start)
        assert out is not None
        return statistics.median(times), out

    results: dict[str, Any] = {}
    for name, seqs in workloads.items():
        plain_s, want = timed(plain, seqs)
        shared_s, got = timed(shared, seqs)
        real = sum(len(s) for s in seqs)
        distinct = {tuple(s) for s in seqs}
        results[name] = {
            "rows": len(seqs), "distinct_prompts": len(distinct), "prompt_tokens": real,
            "distinct_tokens": sum(len(s) for s in distinct),
            "padded_tokens": len(seqs) * max(len(s) for s in seqs),
            "buckets": len(decode.prefill_buckets([len(s) for s in distinct])),
            "plain_s": round(plain_s, 3), "shared_s": round(shared_s, 3),
            "speedup": round(plain_s / shared_s, 2),
            "max_abs_logit_diff": float((got.float() - want.float()).abs().max()),
        }
    out = {
        "benchmark": "prefill", "model": args.model, "threads": args.threads,
        "repeats": args.repeats, "machine": platform.machine(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "workloads": results,
    }
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
