"""Claim: chunked logprobs cut the peak memory of a training step by >= 4x at 16k tokens per
micro-batch, against the same step with the ``[tokens, vocab]`` fp32 logits at once.

Workload: a small Llama built from a config (``--hidden`` wide, ``--layers`` deep, random
weights) with a large vocabulary (``--vocab``, 151936 like Qwen2) so that the logits dominate;
one GRPO group of ``--tokens // --seq-len`` samples of ``--seq-len`` tokens (a short prompt,
the rest completion), trained as ONE micro-batch (``micro_batch_size`` = the samples).
Variants, each in its own process in the same run (so each peak RSS is its own):

- ``chunked``: ``logprob_chunk_tokens = --chunk`` (the default 1024);
- ``unchunked``: one chunk of every loss token of the micro-batch, i.e. the full fp32
  ``[tokens, vocab]`` logits (and their softmax) at once: the memory of the path before
  chunking, by the same code.

Each process loads the model, builds the batch, takes a warm-up step on two 16-token samples
(torch's one-time costs), reads its resident set (VmRSS), takes one ``Trainer.step`` and
reads its high-water mark (``ru_maxrss``); ``step_peak_bytes`` is the difference, the memory
the step itself needed. ``chunked_saving`` = unchunked / chunked. The children run with
``MALLOC_MMAP_THRESHOLD_=131072`` so that RSS follows live tensors (glibc otherwise keeps freed
4-32 MB blocks in its heap and the peak counts fragmentation).
Prints one JSON object with ``--json``.

    .venv/bin/python benchmarks/learner_memory.py --json                 # 16k tokens, 152k vocab
    .venv/bin/python benchmarks/learner_memory.py --json --vocab 32768   # fits ~8 GB of RAM

The unchunked variant at the defaults needs about 40 GB of RAM (10 GB per fp32 logits copy);
``--vocab`` scales it down, the chunked variant stays small either way.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.fsdp_memory import fsdp_vs_ddp

PROMPT = 8


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def build_model(vocab: int, hidden: int, layers: int) -> object:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=4096, tie_word_embeddings=False, pad_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def run_variant(args: argparse.Namespace, chunk: int) -> dict[str, object]:
    """One step in this process; what it measured."""
    import torch

    from streamrl.learner.train import TrainConfig, Trainer
    from streamrl.testing.messages import make_trajectory

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    model = build_model(args.vocab, args.hidden, args.layers)
    samples = args.tokens // args.seq_len
    gen = torch.Generator().manual_seed(0)
    completion = args.seq_len - PROMPT
    prompt = torch.randint(3, args.vocab, (PROMPT,), generator=gen).tolist()
    completions = [torch.randint(3, args.vocab, (completion,), generator=gen).tolist()
                   for _ in range(samples)]  # fmt: skip
    group = make_trajectory(prompt, completions, [[-11.0] * completion] * samples,
                            [float(i % 2) for i in range(samples)])  # fmt: skip
    cfg = TrainConfig(lr=1e-6, micro_batch_size=samples, logprob_chunk_tokens=chunk,
                      max_grad_norm=1e9, num_threads=args.threads)  # fmt: skip
    trainer = Trainer(model, cfg)
    # a warm-up step on two short samples pays torch's one-time costs (thread pools, kernel
    # workspaces) before the measured step
    trainer.step([make_trajectory(prompt, [completions[0][:8]] * 2, [[-11.0] * 8] * 2, [0.0, 1.0])])
    before = _rss_bytes()
    started = time.perf_counter()
    stats = trainer.step([group])
    seconds = time.perf_counter() - started
    peak = _peak_bytes()
    return {
        "chunk_tokens": chunk,
        "tokens": samples * args.seq_len,
        "loss_tokens": stats.tokens,
        "rss_before_step_bytes": before,
        "peak_rss_bytes": peak,
        "step_peak_bytes": peak - before,
        "seconds": round(seconds, 2),
        "loss": stats.loss,
        "grad_norm": stats.grad_norm,
    }


def _child(args: argparse.Namespace, chunk: int) -> dict[str, object]:
    argv = [sys.executable, __file__, "--child-chunk", str(chunk), "--vocab", str(args.vocab),
            "--hidden", str(args.hidden), "--layers", str(args.layers), "--tokens",
            str(args.tokens), "--seq-len", str(args.seq_len),
            "--threads", str(args.threads)]  # fmt: skip
    # glibc raises its mmap threshold to the size of each freed block (up to 32 MB), after
    # which freed logits chunks stay in the heap and RSS counts fragmentation rather than live
    # tensors; a fixed threshold maps and unmaps every large tensor, in both variants alike.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    out = subprocess.run(argv, capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def chunked_vs_unchunked(args: argparse.Namespace) -> dict[str, object]:
    """Both variants, each in a fresh process, and the ratio of their step peaks."""
    chunked = _child(args, args.chunk)
    unchunked = _child(args, args.tokens)  # one chunk: every loss token at once
    saving = float(unchunked["step_peak_bytes"]) / max(float(chunked["step_peak_bytes"]), 1.0)  # type: ignore[arg-type]
    same = abs(float(chunked["loss"]) - float(unchunked["loss"])) <= 1e-5  # type: ignore[arg-type]
    return {"chunked": chunked, "unchunked": unchunked, "chunked_saving": round(saving, 2),
            "same_loss": same}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per micro-batch")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sample")
    parser.add_argument("--chunk", type=int, default=1024, help="logprob_chunk_tokens")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--fsdp-vocab", type=int, default=8192)
    parser.add_argument("--fsdp-hidden", type=int, default=256)
    parser.add_argument("--fsdp-layers", type=int, default=4)
    parser.add_argument("--child-chunk", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_chunk:
        print(json.dumps(run_variant(args, args.child_chunk)))
        return
    result = {
        "benchmark": "learner_memory",
        "model": {"vocab": args.vocab, "hidden": args.hidden, "layers": args.layers},
        "tokens_per_micro_batch": args.tokens,
        "seq_len": args.seq_len,
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
        **chunked_vs_unchunked(args),
        # FSDP2 on 2 ranks against DDP, per-rank parameter + gradient + AdamW bytes
        # (benchmarks/fsdp_memory.py: its own model, --fsdp-vocab/--fsdp-hidden/--fsdp-layers)
        **fsdp_vs_ddp(args.fsdp_vocab, args.fsdp_hidden, args.fsdp_layers),
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for name in ("chunked", "unchunked"):
            r = result[name]
            print(f"{name:10s} step peak {r['step_peak_bytes'] / 2**30:6.2f} GiB "  # type: ignore[index]
                  f"({r['seconds']} s)")  # type: ignore[index]
        print(f"chunked_saving {result['chunked_saving']}x")
        print(f"fsdp_over_ddp {result['fsdp_over_ddp']}")


if __name__ == "__main__":
    main()
