"""Claim: FSDP2 on 2 ranks keeps at most 0.55 of DDP's parameter + gradient + AdamW bytes per
rank (``fsdp_over_ddp``), for the same model and the same step, measured in the same run.

Workload: a Llama built from a config (``--hidden`` wide, ``--layers`` deep, ``--vocab``,
untied embeddings, random weights, the same on every rank), one GRPO step on one group of 4
samples of 24 tokens, on 2 gloo ranks under torchrun. In one process group each rank takes
the step with ``parallelism="ddp"`` and then with ``"fsdp"`` and counts, on itself:

- parameters: the bytes of its parameters (under FSDP the local shards of the DTensors);
- gradients: the bytes of ``p.grad`` of every parameter when the optimiser steps (an optimiser
  step pre-hook; DDP's reducer buckets, a second copy of the gradients, are not counted);
- optimiser: the bytes of every tensor in the AdamW state after the step (two moments per
  parameter, and the step counters).

``fsdp_over_ddp`` is the larger rank's FSDP total over the larger rank's DDP total. Memory
that does not scale with the model (activations, the gathered layer during its forward and
backward, communication buffers) is not in these counts; ``benchmarks/learner_memory.py``
reports the activation side. Prints one JSON object with ``--json``.

    .venv/bin/python benchmarks/fsdp_memory.py --json
    .venv/bin/python benchmarks/learner_memory.py --json     # includes this measurement
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Literal

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _bytes(tensors: Any) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def measure(parallelism: Literal["ddp", "fsdp"], args: argparse.Namespace) -> dict[str, int]:
    """This rank's parameter, gradient and optimiser bytes for one step under ``parallelism``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from streamrl.learner.train import TrainConfig, Trainer
    from streamrl.testing.messages import make_trajectory

    torch.manual_seed(0)  # every rank builds the same weights
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
        tie_word_embeddings=False, pad_token_id=0,
    ))  # fmt: skip
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    config = TrainConfig(lr=1e-4, micro_batch_size=2, num_threads=args.threads,
                         parallelism=parallelism)  # fmt: skip
    trainer = Trainer(model, config)
    grads: list[int] = []
    trainer.optimizer.register_step_pre_hook(
        lambda opt, *_: grads.append(_bytes(p.grad for p in trainer.model.parameters()
                                            if p.grad is not None))
    )  # fmt: skip
    completions = [[3 + (7 * i + j) % 100 for j in range(16)] for i in range(4)]
    group = make_trajectory(list(range(3, 11)), completions, [[-4.0] * 16] * 4,
                            [1.0, 0.0, 0.5, 0.0])  # fmt: skip
    trainer.step([group])
    state = [v for s in trainer.optimizer.state.values() for v in s.values()
             if isinstance(v, torch.Tensor)]  # fmt: skip
    params = _bytes(trainer.model.parameters())
    optimizer = _bytes(state)
    total = params + grads[-1] + optimizer
    return {"model_bytes": whole, "parameter_bytes": params, "gradient_bytes": grads[-1],
            "optimizer_bytes": optimizer, "total_bytes": total}  # fmt: skip


def worker(args: argparse.Namespace) -> None:
    """Under torchrun: both parallelisms in one process group; each rank writes its counts."""
    from streamrl.learner import distributed as dist_util

    assert dist_util.init_from_env()
    counts = {"ddp": measure("ddp", args), "fsdp": measure("fsdp", args)}
    Path(args.worker_out, f"rank{dist_util.rank()}.json").write_text(json.dumps(counts))
    dist_util.teardown()


def fsdp_vs_ddp(vocab: int, hidden: int, layers: int, threads: int = 1) -> dict[str, Any]:
    """Launch the 2-rank worker; per-rank counts of both and ``fsdp_over_ddp``."""
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}
        subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
             __file__, "--vocab", str(vocab), "--hidden", str(hidden), "--layers", str(layers),
             "--threads", str(threads), "--worker-out", out],
            check=True, capture_output=True, text=True, env=env, cwd=ROOT,
        )  # fmt: skip
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in (0, 1)]
    ddp = max(r["ddp"]["total_bytes"] for r in ranks)
    fsdp = max(r["fsdp"]["total_bytes"] for r in ranks)
    return {
        "fsdp_vs_ddp": {"world_size": 2, "model": {"vocab": vocab, "hidden": hidden,
                                                   "layers": layers},
                        "ranks": ranks},
        "fsdp_over_ddp": round(fsdp / ddp, 4),
    }  # fmt: skip


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--worker-out", default="", help=argparse.SUPPRESS)
    return p


def main() -> None:
    args = parser().parse_args()
    if args.worker_out:
        worker(args)
        return
    result = {"benchmark": "fsdp_memory",
              **fsdp_vs_ddp(args.vocab, args.hidden, args.layers, args.threads)}  # fmt: skip
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for name in ("ddp", "fsdp"):
        r = {k: v / 2**20 for k, v in result["fsdp_vs_ddp"]["ranks"][0][name].items()}
        print(f"{name:5s} rank 0 MiB: params {r['parameter_bytes']:7.1f}, grads "
              f"{r['gradient_bytes']:7.1f}, AdamW {r['optimizer_bytes']:7.1f}")
    print(f"fsdp_over_ddp {result['fsdp_over_ddp']}")


if __name__ == "__main__":
    main()
