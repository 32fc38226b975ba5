"""Calibrate the arith demo: starting reward of the real model, generation speed, budget.

    .venv/bin/python benchmarks/calibrate_demo.py [--samples 4] [--max-new-tokens 96] \
        [--out runs/calibrate_demo.json] [--domain arith] [--items 0]

``--domain`` calibrates another domain the same way (math, finance, cad: any domain whose
items have a ``kind``), on its first ``--items`` eval items.

With SmolLM2-135M-Instruct (``resolve_model("smollm2-135m")``) and the in-process
TransformersEngine, on the held-out eval split:
- greedy and T=1 (``--samples`` per item) reward, per task kind, with the real verifier
  and ProcessSandbox;
- the same rewards when completions are cut at 32/48/64/... tokens: one run at the largest
  budget gives every smaller budget, because a decode's first k tokens do not depend on the
  budget (same seed per row);
- why failures fail (no code, crash, timeout, wrong output), mean completion length;
- tokens/s at batch 8/16/32 (T=1, real eval prompts), and the largest gap between the
  engine's logprobs and a teacher-forced forward over prompt + completion.
Prints one JSON object. Simplification: one seed, so T=1 figures carry sampling noise
(~±0.03 at 256 samples).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import trio

from streamrl.domains.registry import get_domain
from streamrl.inference.transformers_engine import TransformersEngine, open_transformers_engine
from streamrl.models import resolve_model
from streamrl.protocol.messages import Sampling
from streamrl.sandbox import ProcessSandbox, opened
from streamrl.testing.logprobs import teacher_forced_logprobs


async def score_all(domain: Any, box: ProcessSandbox, pairs: list[tuple[Any, str]]
                    ) -> list[tuple[float, str]]:
    """(reward, outcome) per (item, text); outcome in correct/no_code/timeout/crash/wrong."""
    out: list[tuple[float, str]] = [(0.0, "")] * len(pairs)
    limiter = trio.CapacityLimiter(2)

    async def one(i: int, item: Any, text: str) -> None:
        request = domain.exec_request(item, text)
        result = None
        if request is not None:
            async with limiter:
                result = await box.run(request)
        reward = domain.score(item, text, result)
        if reward >= 1.0:
            why = "correct"
        elif result is None:
            why = "no_code"
        elif result.timed_out:
            why = "timeout"
        elif result.exit_code != 0:
            why = "crash"
        else:
            why = "wrong_output"
        out[i] = (reward, why)

    async with trio.open_nursery() as nursery:
        for i, (item, text) in enumerate(pairs):
            nursery.start_soon(one, i, item, text)
    return out


def cut_text(engine: TransformersEngine, tokens: np.ndarray, budget: int) -> str:
    return engine.tokenizer.decode(tokens[:budget].tolist(), skip_special_tokens=True)


async def reward_table(engine: TransformersEngine, domain: Any, box: ProcessSandbox,
                       items: list[Any], completions: list[Any], budgets: list[int]
                       ) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for budget in budgets:
        pairs = [(it, cut_text(engine, c.tokens, budget))
                 for it, c in zip(items, completions, strict=True)]
        scored = await score_all(domain, box, pairs)
        by_kind: dict[str, list[float]] = defaultdict(list)
        for it, (r, _) in zip(items, scored, strict=True):
            by_kind[it.kind].append(r)
        table[str(budget)] = {
            "reward": round(statistics.fmean(r for r, _ in scored), 4),
            "outcomes": dict(Counter(why for _, why in scored)),
            "by_kind": {k: round(statistics.fmean(v), 3) for k, v in sorted(by_kind.items())},
        }
    return table


def teacher_forced_gap(engine: TransformersEngine, prompts: list[list[int]],
                       completions: list[Any], temperature: float) -> float:
    gap = 0.0
    for p, c in zip(prompts, completions, strict=True):
        ref = teacher_forced_logprobs(engine.model, p, c.tokens.tolist(), temperature)
        gap = max(gap, float((ref - torch.from_numpy(c.logprobs)).abs().max()))
    return gap


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--domain", default="arith", help="any registered domain with a `kind`")
    ap.add_argument("--items", type=int, default=0, help="first N eval items (0: all)")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--budgets", default="32,48,64,80,96")
    ap.add_argument("--speed-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sampled", default="1.0:1.0",
                    help="comma-separated temperature:top_p settings for the sampled runs")
    ap.add_argument("--no-greedy", action="store_true")
    ap.add_argument("--no-speed", action="store_true")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    budgets = [int(b) for b in args.budgets.split(",") if int(b) <= args.max_new_tokens]

    domain = get_domain(args.domain)
    items = domain.load_items("eval")[: args.items or None]
    report: dict[str, Any] = {"model": args.model, "domain": args.domain,
                              "eval_items": len(items),
                              "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count()}
    box = ProcessSandbox()
    t0 = time.perf_counter()
    async with opened(box), open_transformers_engine(resolve_model(args.model),
                                                     max_batch=32) as engine:
        report["load_s"] = round(time.perf_counter() - t0, 1)
        prompts = [domain.render_prompt(it, engine.tokenizer) for it in items]
        report["prompt_tokens_mean"] = round(statistics.fmean(len(p) for p in prompts), 1)

        runs = {} if args.no_greedy else {
            "greedy": (Sampling(max_new_tokens=args.max_new_tokens, temperature=0.0), 1)}
        for setting in filter(None, args.sampled.split(",")):  # "": greedy only
            temperature, top_p = (float(x) for x in setting.split(":"))
            runs[f"t{temperature:g}_p{top_p:g}"] = (Sampling(
                max_new_tokens=args.max_new_tokens, temperature=temperature, top_p=top_p,
                seed=args.seed), args.samples)
        for name, (sampling, k) in runs.items():
            rows = [p for p in prompts for _ in range(k)]
            row_items = [it for it in items for _ in range(k)]
            t = time.perf_counter()
            completions = await engine.generate(rows, sampling)
            wall = time.perf_counter() - t
            lengths = [len(c.tokens) for c in completions]
            report[name] = {
                "samples": len(rows),
                "wall_s": round(wall, 1),
                "tokens_per_s": round(sum(lengths) / wall, 1),
                "completion_tokens_mean": round(statistics.fmean(lengths), 1),
                "finished_by_stop": round(
                    statistics.fmean(c.finish_reason == "stop" for c in completions), 3),
                "by_budget": await reward_table(engine, domain, box, row_items, completions,
                                                budgets),
                "logprob_gap_vs_teacher_forcing": teacher_forced_gap(
                    engine, rows[:8], completions[:8], sampling.temperature),
                "examples": [c.text for c in completions[:3]],
            }
            print(name, json.dumps(report[name]["by_budget"]), flush=True)

        speed = {}
        for batch in () if args.no_speed else (8, 16, 32):
            sampling = Sampling(max_new_tokens=args.speed_tokens, temperature=1.0, seed=1)
            t = time.perf_counter()
            completions = await engine.generate(prompts[:batch], sampling)
            wall = time.perf_counter() - t
            tokens = sum(len(c.tokens) for c in completions)
            speed[str(batch)] = {"tokens": tokens, "wall_s": round(wall, 2),
                                 "tokens_per_s": round(tokens / wall, 1)}
            print("batch", batch, speed[str(batch)], flush=True)
        if speed:
            report["speed_t1"] = speed
        report["load_average"] = os.getloadavg()
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    trio.run(main)
