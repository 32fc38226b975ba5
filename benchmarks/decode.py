"""Claim: the in-process engine's batch (:func:`streamrl.inference.decode.decode_batch`) is
faster with a key/value cache that writes each step's token in place
(:class:`~streamrl.inference.decode.GrowingLayer`), inverse-CDF sampling
(:func:`~streamrl.inference.decode.sample_inverse_cdf`) and one prefill of the prefix that
distinct prompts share (:func:`~streamrl.inference.decode.prefix_groups`) than with what it
did before, the baseline here, in the same process on the same batches: transformers'
``DynamicLayer``, which concatenates (copies every layer's whole cache at every step), one
``torch.multinomial`` per sampled row (a full-vocabulary exponential draw each), and every
distinct prompt prefilled whole.

Workloads (random token ids, fixed seed, shaped like the demo's ``arith`` prompts with
SmolLM2's chat template: 43-66 tokens, the first 30 the same in all; no stop tokens, so
every row decodes exactly ``--new-tokens`` and both arms do the same work):
- ``train``: ``--groups`` groups of 8 identical prompts at temperature 0.7
  (configs/demo.toml's generator batch: 6 groups, 48 rows);
- ``eval``: 48 distinct prompts, greedy (a held-out round's batch);
- ``train_update``: ``train`` with one weight update halfway (the ``weights`` hook reports a
  new version before step ``--new-tokens // 2``; the weights stay the same): the running rows
  are prefilled again, prompt and tokens so far, as when the learner publishes mid-batch
  (every step in the demo). A group's rows share their prompt there too.
Arms alternate (baseline, candidate, baseline, ...) after one warm-up each; each figure is the
median of ``--repeats``. Greedy tokens must be identical in both arms (``greedy_tokens_equal``:
the cache and the prefill change where keys are stored and in which pass they are computed,
not what they are). Prints one JSON object.

    .venv/bin/python benchmarks/decode.py --json                  # smollm2-135m, one thread
    .venv/bin/python benchmarks/decode.py --json --model tiny --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
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
    ap.add_argument("--groups", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workloads", nargs="+", default=["train", "eval", "train_update"],
                    choices=["train", "eval", "train_update"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="JSON only (the default prints it too)")
    args = ap.parse_args()

    import torch
    from transformers import DynamicCache

    from streamrl.inference import decode
    from streamrl.models import load_model, resolve_model

    torch.set_num_threads(args.threads)
    model = load_model(resolve_model(args.model)).eval()
    vocab = model.config.vocab_size
    rng = random.Random(args.seed)

    head = [rng.randrange(3, vocab) for _ in range(30)]

    def prompt() -> list[int]:
        return head + [rng.randrange(3, vocab) for _ in range(rng.randint(13, 36))]

    train = [p for p in (prompt() for _ in range(args.groups)) for _ in range(8)]
    workloads = {"train": (train, 0.7, False), "eval": ([prompt() for _ in range(48)], 0.0, False),
                 "train_update": (train, 0.7, True)}

    def baseline_cache(model: Any, reserve: int) -> DynamicCache:
        return DynamicCache(config=model.config)

    def baseline_choose(logp: torch.Tensor, rows: list[decode.Row]) -> torch.Tensor:
        chosen = logp.argmax(dim=-1)
        for j, row in enumerate(rows):
            if row.temperature > 0:
                chosen[j] = torch.multinomial(logp[j].exp(), 1, generator=row.generator)[0]
        return chosen

    def baseline_groups(seqs: list[list[int]], min_prefix: int = 0) -> list[tuple[int, list[int]]]:
        return [(0, [i]) for i in range(len(seqs))]

    candidate = {"_new_cache": decode._new_cache, "_choose": decode._choose,
                 "prefix_groups": decode.prefix_groups}
    baseline = {"_new_cache": baseline_cache, "_choose": baseline_choose,
                "prefix_groups": baseline_groups}

    def run(arm: dict[str, Any], seqs: list[list[int]], temperature: float, update: bool
            ) -> tuple[float, list[list[int]]]:
        for name, fn in arm.items():
            setattr(decode, name, fn)
        rows = [decode.Row(prompt=s, max_new_tokens=args.new_tokens, temperature=temperature,
                           generator=torch.Generator().manual_seed(i) if temperature else None)
                for i, s in enumerate(seqs)]
        steps = iter(range(1 << 30))

        def weights() -> int:  # called before every step: version 1 from halfway on
            return int(next(steps) >= args.new_tokens // 2)

        start = time.perf_counter()
        results, _ = decode.decode_batch(model, rows, frozenset(), 0,
                                         weights=weights if update else None)
        return time.perf_counter() - start, [r.tokens for r in results]

    results: dict[str, Any] = {}
    try:
        for name in args.workloads:
            seqs, temperature, update = workloads[name]
            run(baseline, seqs, temperature, update)
            run(candidate, seqs, temperature, update)
            times: dict[str, list[float]] = {"baseline": [], "candidate": []}
            tokens: dict[str, list[list[int]]] = {}
            for _ in range(args.repeats):
                for arm_name, arm in (("baseline", baseline), ("candidate", candidate)):
                    seconds, tokens[arm_name] = run(arm, seqs, temperature, update)
                    times[arm_name].append(seconds)
            generated = len(seqs) * args.new_tokens
            base_s, cand_s = (statistics.median(times[a]) for a in ("baseline", "candidate"))
            results[name] = {
                "rows": len(seqs), "temperature": temperature, "new_tokens": args.new_tokens,
                "weight_update_halfway": update,
                "baseline_s": round(base_s, 3), "candidate_s": round(cand_s, 3),
                "baseline_tokens_per_s": round(generated / base_s, 1),
                "candidate_tokens_per_s": round(generated / cand_s, 1),
                "speedup": round(base_s / cand_s, 3),
                "times_s": {a: [round(t, 3) for t in ts] for a, ts in times.items()},
            }
            if not temperature:
                results[name]["greedy_tokens_equal"] = tokens["baseline"] == tokens["candidate"]
    finally:
        for name, fn in candidate.items():
            setattr(decode, name, fn)
    out = {
        "benchmark": "decode", "model": args.model, "threads": args.threads,
        "repeats": args.repeats, "machine": platform.machine(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "workloads": results,
    }
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
