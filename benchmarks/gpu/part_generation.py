"""Part ``generation`` of ``benchmarks/gpu/check.py``: throughput of the in-process engine the
generator opens (``generator.engine = "transformers"``, :func:`actors.generator.open_engine`:
:func:`inference.transformers_engine.open_transformers_engine`) on the same model.

The model directory is written once (random weights, the tokenizer of :mod:`common`), the
engine is opened on it with no stop token (every completion runs to ``--gen-new-tokens``,
whatever it samples: ``finish_reason`` is always ``length``), warmed up with one two-token
completion, then for each batch size of ``--gen-batches`` one ``generate`` call of that many
random prompts of ``--gen-prompt-len`` tokens at temperature 1 is timed. ``tokens_per_s``
counts the completion tokens the engine returned, ``completions_per_s`` the completions.

The engine decodes on the CPU (it has no GPU path: GPUs serve through SGLang), with torch's
default thread count, in ``generator.dtype = "auto"`` (bf16 where the host CPU has AMX or
AVX512-BF16); the figures say so (``engine_device``, ``threads``, ``engine_dtype``).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import trio
from common import Report, build_model, model_name, save_version


async def measure(engine: Any, batch: int, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    from streamrl.protocol.messages import Sampling

    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(1, vocab, (batch, args.gen_prompt_len), generator=g).tolist()
    sampling = Sampling(max_new_tokens=args.gen_new_tokens, temperature=1.0, seed=batch)
    started = time.perf_counter()
    completions = await engine.generate(prompts, sampling)
    seconds = time.perf_counter() - started
    tokens = sum(len(c.tokens) for c in completions)
    return {
        "batch": batch,
        "seconds": round(seconds, 3),
        "tokens": tokens,
        "tokens_per_s": round(tokens / seconds, 1),
        "completions_per_s": round(len(completions) / seconds, 3),
        "finish_reasons": dict(Counter(c.finish_reason for c in completions)),
    }


async def measure_all(args: argparse.Namespace, report: Report, work: Path) -> None:
    from streamrl.inference.transformers_engine import open_transformers_engine
    from streamrl.protocol.messages import Sampling

    started = time.perf_counter()
    model = build_model(args.tiny, "cpu" if args.cpu else "cuda").cpu()  # quick to initialise
    vocab = int(model.config.vocab_size)
    directory = await trio.to_thread.run_sync(save_version, model, work, 0)
    del model
    batches = [int(b) for b in args.gen_batches.split(",")]
    async with open_transformers_engine(directory, max_batch=max(batches), stop_token_ids=(),
                                        dtype="auto") as engine:  # fmt: skip
        await engine.generate([[1, 2, 3]], Sampling(max_new_tokens=2, seed=0))
        report.update(engine="transformers (in-process)", engine_device="cpu",
                      engine_dtype=str(engine.dtype).removeprefix("torch."),
                      threads=torch.get_num_threads(), model=model_name(args.tiny),
                      prompt_tokens=args.gen_prompt_len, new_tokens=args.gen_new_tokens,
                      setup_s=round(time.perf_counter() - started, 2), batches=[])  # fmt: skip
        for batch in batches:
            figures = await measure(engine, batch, args, vocab)
            report.update(batches=[*report.data["batches"], figures])


def run(args: argparse.Namespace, report: Report) -> None:
    with tempfile.TemporaryDirectory(prefix="gpu-check-gen-") as work:
        trio.run(measure_all, args, report, Path(work))
