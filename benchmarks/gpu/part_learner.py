"""Part ``learner`` of ``benchmarks/gpu/check.py``: one GRPO step of the project's
:meth:`learner.train.Trainer.step_batch` on a synthetic batch, timed under FSDP2 and, side by
side, without it.

- ``fsdp``: ``TrainConfig.parallelism = "fsdp"`` under the process group
  (:func:`common.open_process_group`: one rank, or torchrun's), so the Trainer wraps each
  decoder layer and the root in ``fully_shard`` (:mod:`learner.fsdp`): bf16 parameters with
  fp32 gradient reduction over fp32 sharded master weights on CUDA, fp32 on the CPU;
- ``ddp``: the default ``parallelism``: DistributedDataParallel over several ranks, the plain
  Trainer on one (bf16 autocast over fp32 weights on CUDA), as the learner runs in one process.

Each mode builds the model afresh, takes one warm-up step (kernels, allocator, AdamW state) and
``--steps`` timed ones; the median is reported. ``tokens_per_s`` counts every token of the
batch (prompt and completion), ``trained_tokens_per_s`` the completion tokens only.

Model FLOPs (the work the step must do, not what the hardware did: activation checkpointing's
recomputation is not counted), after PaLM (Chowdhery et al. 2022, appendix B) with the output
head where the learner computes it::

    6 * N_body * tokens                 # every matmul of the decoder, forward + backward
    + 6 * vocab * hidden * trained      # the output head, on the loss positions only
    + 12 * layers * q_width * seq * tokens   # attention scores and values (no causal halving)

``N_body``: the parameters outside the embedding and the output head; ``q_width``: heads x
head dim. ``mfu`` = model FLOPs per second / (peak x ranks); the peak is the device's dense
bf16 tensor peak from :data:`PEAK_BF16_TFLOPS` (``--peak-tflops`` overrides it); on the CPU,
or on a device not in the table, it is null.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any, Literal

import torch
from common import (
    QWEN2_05B,
    TINY,
    Report,
    build_model,
    device_name,
    open_process_group,
    sync,
    synthetic_batch,
)

Mode = Literal["fsdp", "ddp"]

PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    # dense (no sparsity) bf16 tensor-core peaks from NVIDIA's data sheets; the first name
    # found in torch.cuda.get_device_name() wins, so the more specific names come first
    ("B200", 2250.0),
    ("H200", 989.0),  # GH200 too
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),  # SXM
    ("H800", 989.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
)


def peak_tflops(device: str, override: float | None) -> tuple[float | None, str]:
    """(dense bf16 peak in TFLOP/s, where it came from)."""
    if override is not None:
        return override, "--peak-tflops"
    if not device.startswith("cuda"):
        return None, "cpu: no MFU"
    name = torch.cuda.get_device_name()
    for key, value in PEAK_BF16_TFLOPS:
        if key in name:
            return value, f"table: {key}"
    return None, f"{name!r} not in the table: pass --peak-tflops"


def model_flops(model: Any, tokens: int, trained: int, seq: int) -> float:
    """The step's model FLOPs (see the module docstring); call before the model is sharded."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    body = sum(p.numel() for n, p in model.named_parameters()
               if "embed_tokens" not in n and "lm_head" not in n)  # fmt: skip
    return float(
        6 * body * tokens
        + 6 * c.vocab_size * c.hidden_size * trained
        + 12 * c.num_hidden_layers * c.num_attention_heads * head_dim * seq * tokens
    )


def measure(mode: Mode, args: argparse.Namespace, batch: Any, device: str, world: int,
            peak: float | None) -> dict[str, Any]:  # fmt: skip
    """Build, warm up and time ``--steps`` steps of ``mode`` ("fsdp" or "ddp")."""
    from streamrl.learner.train import TrainConfig, Trainer

    if device.startswith("cuda"):
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    model = build_model(args.tiny, device)
    tokens, trained = int(batch.attention_mask.sum()), int(batch.loss_mask.sum())
    flops = model_flops(model, tokens, trained, batch.input_ids.shape[1])
    config = TrainConfig(lr=1e-6, device=device, bf16=True, parallelism=mode,
                         micro_batch_size=args.micro_batch_size,
                         grad_checkpointing=args.grad_checkpointing)  # fmt: skip
    trainer = Trainer(model, config)
    build_s = time.perf_counter() - started
    times, stats = [], None
    for i in range(args.steps + 1):
        sync(device)
        t = time.perf_counter()
        stats = trainer.step_batch(batch, groups=max(args.samples // 8, 1))
        sync(device)
        if i:  # the first step is the warm-up
            times.append(time.perf_counter() - t)
    assert stats is not None
    step_s = statistics.median(times)
    wrapper = ("FSDP2 fully_shard" if trainer.fsdp is not None
               else "DistributedDataParallel" if trainer.ddp is not None
               else "none (one rank: the plain Trainer)")  # fmt: skip
    cuda = device.startswith("cuda")
    out = {
        "wrapper": wrapper,
        "precision": ("bf16 params, fp32 reduce + master weights" if cuda and mode == "fsdp"
                      else "bf16 autocast over fp32 weights" if cuda else "fp32"),
        "build_s": round(build_s, 2),
        "step_s_median": round(step_s, 4),
        "step_s_all": [round(x, 4) for x in times],
        "tokens_per_s": round(tokens / step_s, 1),
        "trained_tokens_per_s": round(trained / step_s, 1),
        "model_flops_per_step": float(f"{flops:.4g}"),
        "achieved_tflops": float(f"{flops / step_s / 1e12:.4g}"),
        "mfu": None if peak is None else round(flops / step_s / (peak * 1e12 * world), 4),
        "loss": stats.loss,
        "grad_norm": stats.grad_norm,
        "peak_gpu_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
        if cuda else None,
    }
    del trainer, model
    return out


def run(args: argparse.Namespace, report: Report) -> None:
    device = "cpu" if args.cpu else "cuda"
    world = open_process_group(device)
    peak, source = peak_tflops(device, args.peak_tflops)
    vocab = (TINY if args.tiny else QWEN2_05B)["vocab_size"]
    batch = synthetic_batch(args.samples, args.prompt_len, args.completion_len, vocab)
    report.update(
        device=device_name(device), world_size=world,
        parameters=sum(p.numel() for p in build_model(args.tiny, "meta").parameters()),
        samples=args.samples,
        sequence_tokens=args.prompt_len + args.completion_len,
        tokens_per_step=int(batch.attention_mask.sum()),
        trained_tokens_per_step=int(batch.loss_mask.sum()),
        micro_batch_size=args.micro_batch_size, grad_checkpointing=args.grad_checkpointing,
        peak_tflops=peak, peak_source=source,
        flops_formula="6*N_body*tokens + 6*vocab*hidden*trained_tokens "
                      "+ 12*layers*q_width*seq*tokens (PaLM app. B; head on trained tokens)",
    )  # fmt: skip
    modes: tuple[Mode, ...] = ("fsdp", "ddp")
    for mode in modes:
        report.update(**{mode: measure(mode, args, batch, device, world, peak)})
