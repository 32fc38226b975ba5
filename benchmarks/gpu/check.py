"""Learner figures on one accelerator: step time and tokens/s of a 0.5B-class model in bf16,
and the time to save and load its weights. Prints one JSON object.

The model is built from a config (Qwen2-0.5B's shape: 24 layers, hidden 896, 14 heads / 2
KV heads, vocabulary 151936, tied embeddings; random weights), so nothing is downloaded.
The step is the project's own :meth:`learner.train.Trainer.step_batch` (GRPO/PPO-clip loss,
bf16 autocast, fp32 weights and AdamW, gradient clipping) on a synthetic batch of
``--samples`` sequences of ``--prompt-len`` + ``--completion-len`` tokens. Weights go
through :func:`learner.weights.save_weights` (safetensors, fsynced, atomic rename) and come
back with :func:`learner.weights.load_state_into` (in place) and a full ``from_pretrained``.

Needs python, torch, transformers (and safetensors, which transformers brings); not msgspec,
not Redis, not SGLang.

    bash benchmarks/gpu/check.sh                      # GPU, 0.5B, bf16 (a few minutes)
    bash benchmarks/gpu/check.sh --cpu --tiny         # CPU smoke run (seconds)
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from streamrl.learner.batch import Batch
from streamrl.learner.train import TrainConfig, Trainer
from streamrl.learner.weights import load_state_into, save_weights, version_dir

QWEN2_05B = {
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
TINY = {**QWEN2_05B, "vocab_size": 4096, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip


def build_model(tiny: bool) -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**(TINY if tiny else QWEN2_05B), attn_implementation="sdpa")
    return Qwen2ForCausalLM(config)


def synthetic_batch(args: argparse.Namespace, vocab: int) -> Batch:
    """``samples`` rows of prompt + completion, groups of 8 with rewards 0/1 (advantage +-1)."""
    g = torch.Generator().manual_seed(0)
    n, p, c = args.samples, args.prompt_len, args.completion_len
    width = p + c
    input_ids = torch.randint(0, vocab, (n, width), generator=g)
    loss_mask = torch.zeros(n, width - 1)
    loss_mask[:, p - 1 :] = 1.0
    advantages = torch.where(torch.arange(n) % 2 == 0, 1.0, -1.0)[:, None] * loss_mask
    return Batch(
        input_ids=input_ids,
        attention_mask=torch.ones(n, width, dtype=torch.int64),
        loss_mask=loss_mask,
        old_logprobs=torch.full((n, width - 1), -float(torch.log(torch.tensor(vocab)))) * loss_mask,
        advantages=advantages,
        temperature=torch.ones(n),
        rewards=(torch.arange(n) % 2 == 0).float(),
        lengths=torch.full((n,), width, dtype=torch.int64),
    )


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu", action="store_true", help="run on the CPU (smoke test)")
    p.add_argument("--tiny", action="store_true", help="a tiny config instead of 0.5B")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--completion-len", type=int, default=768)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up")
    p.add_argument("--grad-checkpointing", action="store_true")
    args = p.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: pass --cpu (with --tiny) for a CPU smoke run")
    device = "cpu" if args.cpu else "cuda"

    t0 = time.perf_counter()
    model = build_model(args.tiny)
    params = sum(p.numel() for p in model.parameters())
    trainer = Trainer(
        model,
        TrainConfig(lr=1e-6, device=device, bf16=True, micro_batch_size=args.micro_batch_size,
                    grad_checkpointing=args.grad_checkpointing),
    )  # fmt: skip
    build_s = time.perf_counter() - t0
    batch = synthetic_batch(args, model.config.vocab_size)
    tokens_total = int(batch.attention_mask.sum())
    tokens_trained = int(batch.loss_mask.sum())

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, stats = [], None
    for i in range(args.steps + 1):
        sync(device)
        t = time.perf_counter()
        stats = trainer.step_batch(batch, groups=args.samples // 8)
        sync(device)
        if i:  # the first step is warm-up (kernels, allocator, AdamW state)
            times.append(time.perf_counter() - t)
    step_s = sorted(times)[len(times) // 2]
    assert stats is not None

    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    try:
        sync(device)
        t = time.perf_counter()
        no_tokenizer = work / "no-tokenizer"  # an empty directory: config + weights only
        no_tokenizer.mkdir()
        save_weights(trainer.model, no_tokenizer, work, 1, keep_last=2)
        save_s = time.perf_counter() - t
        size = sum(f.stat().st_size for f in version_dir(work, 1).iterdir())
        t = time.perf_counter()
        load_state_into(trainer.model, version_dir(work, 1))
        sync(device)
        load_inplace_s = time.perf_counter() - t
        from transformers import AutoModelForCausalLM

        t = time.perf_counter()
        fresh = AutoModelForCausalLM.from_pretrained(version_dir(work, 1), dtype=torch.bfloat16)
        fresh.to(device)
        sync(device)
        load_fresh_s = time.perf_counter() - t
    finally:
        shutil.rmtree(work, ignore_errors=True)

    out = {
        "benchmark": "gpu_check",
        "device": torch.cuda.get_device_name()
        if device == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "model": "tiny Qwen2 config" if args.tiny else "Qwen2-0.5B-shaped Qwen2Config, random",
        "parameters": params,
        "dtype": "bf16 autocast, fp32 weights + AdamW" if device == "cuda" else "fp32 (CPU)",
        "samples": args.samples,
        "sequence_tokens": args.prompt_len + args.completion_len,
        "micro_batch_size": args.micro_batch_size,
        "grad_checkpointing": args.grad_checkpointing,
        "build_s": round(build_s, 2),
        "step_s_median": round(step_s, 4),
        "step_s_all": [round(x, 4) for x in times],
        "tokens_per_s": round(tokens_total / step_s, 1),
        "trained_tokens_per_s": round(tokens_trained / step_s, 1),
        "loss": stats.loss,
        "grad_norm": stats.grad_norm,
        "peak_gpu_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
        if device == "cuda"
        else None,
        "weights_bytes": size,
        "save_s": round(save_s, 3),
        "load_in_place_s": round(load_inplace_s, 3),
        "load_from_pretrained_s": round(load_fresh_s, 3),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
