"""Claim: which engine should generate the demo's tokens on this machine. The same workloads
through every engine, one after the other in one run, each through the
:class:`~inference.engine.Engine` interface the generators use, with ratios against the
in-process engine (the baseline):

- ``in-process``: :class:`~inference.transformers_engine.TransformersEngine` in this process;
- ``serve-model``: ``streamrl serve-model`` (the same engine behind SGLang's protocol) through
  the SGLang client;
- ``vllm``: a vLLM server (its CPU build, compiled mode unless ``--vllm-eager``) through the
  vLLM client, as ``streamrl up`` starts it (``inference/vllm_server.py``).

Every engine gets ``--threads`` threads and ``--dtype`` (auto: bf16 where the CPU has it, as
the demo), and runs alone (a server is stopped before the next starts). Workloads, on the
demo's real prompts (``arith`` held-out items through the model's chat template):

- ``train``: 6 groups of 8 identical prompts, temperature 0.7, 64 new tokens (a generator's
  batch in configs/demo.toml); tokens/s over the tokens generated (rows may stop early);
- ``eval``: 48 distinct prompts, greedy, 64 new tokens (a held-out round's batch);
- ``multi_turn``: one episode of ``--turns`` turns; each turn's prompt is the last one plus
  the completion and a tool observation of about 200 tokens (the shape of a code-repair
  episode), 32 new tokens: per-turn latency, and the prompt tokens the engine served from its
  prefix cache (vLLM's ``prefix_cache_hits`` counter; the in-process engine and serve-model
  keep no cache between calls: 0);
- ``weight_update``: publish -> first token on the new weights: ``update_weights`` of a
  published directory, then one greedy token (median of ``--repeats``).

Mismatch: on the ``train`` completions, a teacher-forced float32 forward (the learner) against
each engine's logprobs: mean ``|log r|`` and the k3 KL estimate (bf16 engines differ from the
fp32 learner by their rounding; the importance weights correct it).

Prints one JSON object (``ratio_vs_in_process``: the in-process engine's seconds over the
engine's, per workload: above 1 is faster).

    .venv/bin/python benchmarks/engines.py --json
    .venv/bin/python benchmarks/engines.py --json --model tiny --repeats 1 --vllm-eager
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

OBSERVATION = (" The tests ran: 3 passed, 1 failed. FAILED test_parse.py::test_empty - "
               "AssertionError: expected [] but got None. Traceback: parse.py line 12 in "
               "parse, return None if not text else text.split(','). ") * 4


def vllm_counter(url: str, name: str) -> float:
    import httpx

    text = httpx.get(url + "/metrics", timeout=30).text
    match = re.search(rf"^vllm:{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


@asynccontextmanager
async def open_arm(arm: str, model_dir: Path, spec: str, args: argparse.Namespace,
                   logs: Path) -> AsyncIterator[tuple[Any, str, float]]:
    """(the engine, its server's URL or "", seconds it took to be ready)."""
    import trio

    from streamrl.inference.engine import model_stop_token_ids
    from streamrl.inference.sglang_client import open_sglang_engine
    from streamrl.inference.transformers_engine import open_transformers_engine
    from streamrl.inference.vllm_client import open_vllm_engine
    from streamrl.models import load_tokenizer

    start = time.perf_counter()
    if arm == "in-process":
        async with open_transformers_engine(model_dir, max_batch=64, threads=args.threads,
                                            dtype=args.dtype) as engine:
            yield engine, "", time.perf_counter() - start
        return
    if arm == "serve-model":
        from streamrl.testing.serve_model import start_serve_model, wait_healthy

        server = start_serve_model(logs, model=spec, dtype=args.dtype, threads=args.threads,
                                   max_batch=64)
        try:
            await trio.to_thread.run_sync(wait_healthy, server)
            async with open_sglang_engine([server.url], health_interval_s=60) as engine:
                yield engine, server.url, time.perf_counter() - start
        finally:
            server.kill()
        return
    from streamrl.testing.vllm_server import start_vllm, wait_vllm_healthy

    server = start_vllm(logs, model_dir, dtype=args.dtype, threads=args.threads,
                        enforce_eager=args.vllm_eager, kv_cache_gib=2,
                        max_model_len=args.max_model_len)
    try:
        await trio.to_thread.run_sync(wait_vllm_healthy, server, 900.0)
        tokenizer = load_tokenizer(model_dir)
        async with open_vllm_engine([server.url], tokenizer=tokenizer, health_interval_s=60,
                                    stop_token_ids=model_stop_token_ids(model_dir, tokenizer)
                                    ) as engine:
            yield engine, server.url, time.perf_counter() - start
    finally:
        server.kill()


async def generate(engine: Any, prompts: list[list[int]], sampling: Any,
                   session: str | None = None) -> list[Any]:
    from streamrl.inference.http_engine import HTTPEngine

    if isinstance(engine, HTTPEngine):
        return list(await engine.generate(prompts, sampling, session=session))
    return list(await engine.generate(prompts, sampling))


async def measure(arm: str, args: argparse.Namespace, model_dir: Path, workloads: dict,
                  episode: list[int], tokenizer: Any, logs: Path, publish: Path
                  ) -> dict[str, Any]:
    from streamrl.protocol.messages import Sampling

    out: dict[str, Any] = {}
    async with open_arm(arm, model_dir, args.model, args, logs) as (engine, url, ready_s):
        out["ready_s"] = round(ready_s, 1)
        completions: dict[str, list[Any]] = {}
        for name, (prompts, temperature) in workloads.items():
            sampling = Sampling(max_new_tokens=args.new_tokens, temperature=temperature,
                                seed=1 if temperature else None)
            await generate(engine, prompts, sampling)  # warm-up
            times, tokens = [], []
            for _ in range(args.repeats):
                start = time.perf_counter()
                completions[name] = await generate(engine, prompts, sampling)
                times.append(time.perf_counter() - start)
                tokens.append(sum(len(c.tokens) for c in completions[name]))
            seconds = statistics.median(times)
            out[name] = {"rows": len(prompts), "seconds": round(seconds, 3),
                         "tokens": int(statistics.median(tokens)),
                         "tokens_per_s": round(statistics.median(tokens) / seconds, 1),
                         "times_s": [round(t, 3) for t in times]}
        out["_train_completions"] = completions["train"]

        # one episode: every turn's prompt extends the last (sticky session: one server)
        turns = []
        prompt = list(episode)
        observation = tokenizer.encode(OBSERVATION, add_special_tokens=False)
        for turn in range(args.turns):
            hits = vllm_counter(url, "prefix_cache_hits_total") if arm == "vllm" else 0.0
            start = time.perf_counter()
            [c] = await generate(engine, [prompt], Sampling(max_new_tokens=32, temperature=0.0),
                                 session="episode")
            seconds = time.perf_counter() - start
            cached = (vllm_counter(url, "prefix_cache_hits_total") - hits
                      if arm == "vllm" else 0.0)
            turns.append({"turn": turn, "prompt_tokens": len(prompt), "seconds": round(seconds, 3),
                          "cached_prompt_tokens": int(cached)})
            prompt = [*prompt, *c.tokens.tolist(), *observation]
        out["multi_turn"] = {"turns": turns,
                             "seconds": round(sum(t["seconds"] for t in turns), 3),
                             "cached_share_last_turn": round(
                                 turns[-1]["cached_prompt_tokens"] / turns[-1]["prompt_tokens"], 3)}

        # publish -> first token on the new weights
        updates, first = [], []
        for i in range(args.repeats):
            version = 10 + i
            start = time.perf_counter()
            await engine.update_weights(publish, version)
            loaded = time.perf_counter()
            [c] = await generate(engine, [workloads["eval"][0][0]],
                                 Sampling(max_new_tokens=1, temperature=0.0))
            done = time.perf_counter()
            assert c.weight_version == version, (c.weight_version, version)
            updates.append(loaded - start)
            first.append(done - start)
        out["weight_update"] = {"seconds": round(statistics.median(first), 3),
                                "load_s": round(statistics.median(updates), 3),
                                "times_s": [round(t, 3) for t in first]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--engines", default="in-process,serve-model,vllm")
    ap.add_argument("--threads", type=int, default=1, help="each engine's threads")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--vllm-eager", action="store_true", help="vLLM without compiling")
    ap.add_argument("--json", action="store_true", help="JSON only (the default prints it too)")
    args = ap.parse_args()

    import torch
    import trio

    from streamrl.domains.registry import get_domain
    from streamrl.inference.transformers_engine import native_bf16
    from streamrl.models import load_model, load_tokenizer, resolve_model
    from streamrl.testing.logprobs import teacher_forced_logprobs

    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    tokenizer = load_tokenizer(model_dir)
    arith = get_domain("arith")
    prompts = [arith.render_prompt(item, tokenizer) for item in arith.load_items("eval")[:48]]
    workloads = {"train": ([p for p in prompts[:6] for _ in range(8)], 0.7),
                 "eval": (prompts, 0.0)}
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        publish = Path(tmp) / "v000010"  # a published version: the same weights, copied
        shutil.copytree(model_dir, publish)
        for arm in args.engines.split(","):
            logs = Path(tmp) / arm
            logs.mkdir()
            results[arm] = trio.run(measure, arm, args, model_dir, workloads, prompts[0],
                                    tokenizer, logs, publish)
    learner = load_model(model_dir).eval()
    train_prompts, temperature = workloads["train"]
    for r in results.values():
        log_r = torch.cat([
            teacher_forced_logprobs(learner, p, c.tokens.tolist(), temperature)
            - torch.from_numpy(c.logprobs)
            for p, c in zip(train_prompts, r.pop("_train_completions"), strict=True)])
        ratio = log_r.exp()
        r["mismatch_vs_fp32_learner"] = {
            "tokens": len(log_r), "mean_abs_log_ratio": round(float(log_r.abs().mean()), 6),
            "k3_kl_mean": round(float((ratio - 1 - log_r).mean()), 8)}
    base = results.get("in-process")
    ratios: dict[str, Any] = {}
    if base:
        for arm, r in results.items():
            ratios[arm] = {w: round(base[w]["seconds"] / r[w]["seconds"], 3)
                           for w in ("train", "eval", "multi_turn", "weight_update")}
    out = {
        "benchmark": "engines", "model": args.model, "threads": args.threads,
        "dtype": args.dtype, "native_bf16": native_bf16(), "repeats": args.repeats,
        "new_tokens": args.new_tokens, "vllm_compiled": not args.vllm_eager,
        "machine": platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
        "engines": results, "ratio_vs_in_process": ratios,
    }
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
