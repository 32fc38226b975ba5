"""Claim: on a CPU that multiplies bf16 in hardware (AMX or AVX512-BF16), the in-process
engine decodes the demo's batches faster holding the policy in bfloat16 (``generator.dtype``)
than in float32, the baseline, in the same process on the same batches; and the bf16
behaviour logprobs stay close to what the float32 learner computes for the same tokens (the
train-vs-rollout mismatch that the learner's importance weights, ``learner.tis_cap``, correct).

Workloads: the demo's real prompts (``arith`` held-out items through SmolLM2's chat
template), ``max_new_tokens`` 64 and no stop tokens, so every row decodes the same number of
tokens in both arms:
- ``train``: 6 groups of 8 identical prompts at temperature 0.7 (a generator's batch in
  configs/demo.toml);
- ``eval``: 48 distinct prompts, greedy (a held-out round's batch).
Arms alternate (fp32, bf16, fp32, ...) after one warm-up each; each time is the median of
``--repeats``.

Mismatch (``train`` workload, each arm's last completions): a teacher-forced float32 forward
over prompt + completion at the sampling temperature (the learner's logprobs) against the
logprobs the engine reported. Per token ``r = exp(learner - behaviour)``: mean and max
``|log r|``, the mean k3 estimate of KL(behaviour || learner) (``r - 1 - log r``), ``r``'s
min and max, and the share of tokens with ``r`` above ``--tis-cap`` (those the learner's
truncated weights clip). The fp32 arm's figures are the engine's own float noise (a KV cache
against one forward pass). ``eval``: the share of rows whose greedy tokens are the same in
both arms, and where the first difference falls.

Prints one JSON object (``speedup``: fp32 seconds over bf16 seconds, per workload).

    .venv/bin/python benchmarks/serving_dtype.py --json
    .venv/bin/python benchmarks/serving_dtype.py --json --model tiny --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the engine's own)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tis-cap", type=float, default=2.0)
    ap.add_argument("--json", action="store_true", help="JSON only (the default prints it too)")
    args = ap.parse_args()

    import torch

    from streamrl.domains.registry import get_domain
    from streamrl.inference import decode
    from streamrl.inference.transformers_engine import native_bf16
    from streamrl.models import load_model, load_tokenizer, resolve_model
    from streamrl.testing.logprobs import teacher_forced_logprobs

    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    tokenizer = load_tokenizer(model_dir)
    models = {"fp32": load_model(model_dir).eval(),
              "bf16": load_model(model_dir, dtype=torch.bfloat16).eval()}
    vocab = models["fp32"].config.vocab_size
    arith = get_domain("arith")
    prompts = [[t % vocab for t in arith.render_prompt(item, tokenizer)]
               for item in arith.load_items("eval")[:48]]
    workloads = {"train": ([p for p in prompts[:6] for _ in range(8)], 0.7),
                 "eval": (prompts, 0.0)}

    def run(arm: str, seqs: list[list[int]], temperature: float
            ) -> tuple[float, list[decode.RowResult]]:
        rows = [decode.Row(prompt=s, max_new_tokens=args.new_tokens, temperature=temperature,
                           generator=torch.Generator().manual_seed(i) if temperature else None)
                for i, s in enumerate(seqs)]
        start = time.perf_counter()
        with torch.inference_mode():
            results, _ = decode.decode_batch(models[arm], rows, frozenset(), 0)
        return time.perf_counter() - start, results

    timings: dict[str, Any] = {}
    last: dict[str, dict[str, list[decode.RowResult]]] = {}
    for name, (seqs, temperature) in workloads.items():
        for arm in models:
            run(arm, seqs, temperature)  # warm-up
        times: dict[str, list[float]] = {arm: [] for arm in models}
        last[name] = {}
        for _ in range(args.repeats):
            for arm in models:
                seconds, last[name][arm] = run(arm, seqs, temperature)
                times[arm].append(seconds)
        generated = len(seqs) * args.new_tokens
        fp32_s, bf16_s = (statistics.median(times[a]) for a in models)
        timings[name] = {
            "rows": len(seqs), "temperature": temperature, "new_tokens": args.new_tokens,
            "fp32_s": round(fp32_s, 3), "bf16_s": round(bf16_s, 3),
            "fp32_tokens_per_s": round(generated / fp32_s, 1),
            "bf16_tokens_per_s": round(generated / bf16_s, 1),
            "speedup": round(fp32_s / bf16_s, 3),
            "times_s": {a: [round(t, 3) for t in ts] for a, ts in times.items()},
        }

    train_seqs, train_t = workloads["train"]
    mismatch = {}
    for arm in models:
        log_r = torch.cat([
            teacher_forced_logprobs(models["fp32"], p, r.tokens, train_t)
            - torch.tensor(r.logprobs)
            for p, r in zip(train_seqs, last["train"][arm], strict=True)])
        r = log_r.exp()
        mismatch[arm] = {
            "tokens": len(log_r),
            "mean_abs_log_ratio": round(float(log_r.abs().mean()), 6),
            "max_abs_log_ratio": round(float(log_r.abs().max()), 6),
            "k3_kl_mean": round(float((r - 1 - log_r).mean()), 8),
            "ratio_min": round(float(r.min()), 4), "ratio_max": round(float(r.max()), 4),
            "above_tis_cap": round(float((r > args.tis_cap).float().mean()), 6),
        }
    same, first_diff = 0, []
    for a, b in zip(last["eval"]["fp32"], last["eval"]["bf16"], strict=True):
        if a.tokens == b.tokens:
            same += 1
        else:
            pairs = enumerate(zip(a.tokens, b.tokens, strict=True))
            first_diff.append(next(i for i, (x, y) in pairs if x != y))
    out = {
        "benchmark": "serving_dtype", "model": args.model, "threads": args.threads,
        "repeats": args.repeats, "machine": platform.machine(),
        "native_bf16": native_bf16(), "torch": torch.__version__,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "workloads": timings,
        "mismatch_vs_fp32_learner": mismatch,
        "greedy_rows_identical": round(same / len(last["eval"]["fp32"]), 4),
        "greedy_first_difference_median": statistics.median(first_diff) if first_diff else None,
    }
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
