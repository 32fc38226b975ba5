"""Claim: under LoRA the learner's trainable state (gradients, AdamW moments, the
``trainer_state.pt`` each checkpoint carries) is a small fraction of full fine-tuning's,
while every version still publishes a full merged model for the generators.

Workload: SmolLM2-135M's architecture built from its config (random weights, fp32), one
GRPO step on one group of 4 samples of 48 tokens, then the version directory the learner
actor writes. Variants, in the same run: ``full`` (every weight trains) and ``lora`` (rank
``--rank`` on q/k/v/o/gate/up/down, ``publish = "merged"``). Reported per variant: trainable
parameters, AdamW state bytes (in memory), bytes of ``trainer_state.pt``, of the published
``model.safetensors`` and (LoRA) of ``adapter/adapter_model.safetensors``; ``state_ratio``
= LoRA's trainer state over full fine-tuning's.

    .venv/bin/python benchmarks/lora_checkpoint.py --json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from streamrl.learner.checkpoint import TRAINER_STATE_FILE, save_trainer_state
from streamrl.learner.lora import (
    ADAPTER_SUBDIR,
    ADAPTER_WEIGHTS,
    LoraExport,
    LoraSettings,
)
from streamrl.learner.train import TrainConfig, Trainer
from streamrl.learner.weights import WEIGHTS_FILE, save_weights
from streamrl.models import resolve_model
from streamrl.testing.messages import make_trajectory

SMOLLM2_135M = {  # HuggingFaceTB/SmolLM2-135M-Instruct's config.json
    "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "max_position_embeddings": 8192, "tie_word_embeddings": True, "rope_theta": 100000.0,
}  # fmt: skip


def _group() -> Any:
    rng = random.Random(0)
    comps = [[rng.randrange(3, 49000) for _ in range(40)] for _ in range(4)]
    lps = [[-rng.uniform(1, 8) for _ in c] for c in comps]
    return make_trajectory(list(range(1, 9)), comps, lps, [1.0, 0.0, 0.5, 0.0])


def _variant(lora: LoraSettings | None, out: Path) -> dict[str, Any]:
    torch.manual_seed(0)
    trainer = Trainer(LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)),
                      TrainConfig(lr=1e-4, lora=lora, micro_batch_size=4))  # fmt: skip
    trainer.step([_group()])
    moments = trainer.optimizer.state_dict()["state"].values()
    policy = trainer.policy if lora is None else LoraExport(trainer.policy, lora.publish)
    path = save_weights(policy, resolve_model("tiny"), out, 1, keep_last=1,
                        extra=lambda d: save_trainer_state(trainer.optimizer, trainer.steps, d))
    adapter = path / ADAPTER_SUBDIR / ADAPTER_WEIGHTS
    return {
        "parameters": sum(p.numel() for p in trainer.model.parameters()),
        "trainable_parameters": sum(p.numel() for p in trainer.model.parameters()
                                    if p.requires_grad),
        "adam_state_bytes": sum(t.numel() * t.element_size() for s in moments
                                for t in s.values() if t.dim() > 0),
        "trainer_state_file_bytes": (path / TRAINER_STATE_FILE).stat().st_size,
        "published_model_bytes": (path / WEIGHTS_FILE).stat().st_size,
        "adapter_file_bytes": adapter.stat().st_size if adapter.exists() else 0,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        full = _variant(None, Path(tmp) / "full")
        lora = _variant(LoraSettings(rank=args.rank, alpha=2 * args.rank), Path(tmp) / "lora")
    result = {
        "model": "SmolLM2-135M architecture (random weights, fp32)",
        "rank": args.rank,
        "full": full,
        "lora": lora,
        "state_ratio": lora["trainer_state_file_bytes"] / full["trainer_state_file_bytes"],
    }
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
