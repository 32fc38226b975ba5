"""What the parts of ``benchmarks/gpu/check.py`` share: the model (Qwen2-0.5B's shape with
random weights, or a tiny config of it), a Hugging Face directory of it with a tokenizer made
here (nothing is downloaded), the synthetic GRPO batch, a process group of one rank, and the
part's figures file.

Imports torch and transformers only (and the learner's modules on demand), so the learner part
runs on a machine that has nothing else.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

QWEN2_05B: dict[str, Any] = {
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
TINY: dict[str, Any] = {**QWEN2_05B, "vocab_size": 4096, "hidden_size": 64,
                        "intermediate_size": 128, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
WORDS = 256
"""The tokenizer's vocabulary: ``<|endoftext|>`` (id 0: pad and EOS) and ``w1`` .. ``w255``.
Ids beyond it (the model's vocabulary is larger) decode to nothing."""


def model_name(tiny: bool) -> str:
    return "tiny Qwen2 config, random" if tiny else "Qwen2-0.5B-shaped Qwen2Config, random"


def build_model(tiny: bool, device: str = "cpu") -> Any:
    """The model with seeded random weights, initialised on ``device`` (fast on a GPU)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    settings = {**(TINY if tiny else QWEN2_05B), "bos_token_id": 0, "eos_token_id": 0,
                "pad_token_id": 0, "attn_implementation": "sdpa"}  # fmt: skip
    config = Qwen2Config(**settings)
    with torch.device(device):
        return Qwen2ForCausalLM(config)


def word_tokenizer() -> Any:
    """A word-level tokenizer of :data:`WORDS` entries (the engine and the server need one to
    decode; the prompts here are token ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, **{f"w{i}": i for i in range(1, WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>")


def save_version(model: Any, root: Path, version: int) -> Path:
    """``model`` (CPU) with the tokenizer as ``root/v{version:06d}``, through the learner's
    :func:`learner.weights.save_weights` (fsynced, renamed into place)."""
    from streamrl.learner.weights import save_weights

    return save_weights(model, word_tokenizer(), root, version, keep_last=3)


def synthetic_batch(samples: int, prompt_len: int, completion_len: int, vocab: int) -> Any:
    """``samples`` rows of prompt + completion, rewards alternating 1/0 (advantage +-1), the
    behaviour logprobs those of a uniform policy."""
    from streamrl.learner.batch import Batch

    g = torch.Generator().manual_seed(0)
    n, p, width = samples, prompt_len, prompt_len + completion_len
    loss_mask = torch.zeros(n, width - 1)
    loss_mask[:, p - 1 :] = 1.0
    advantages = torch.where(torch.arange(n) % 2 == 0, 1.0, -1.0)[:, None] * loss_mask
    return Batch(
        input_ids=torch.randint(0, vocab, (n, width), generator=g),
        attention_mask=torch.ones(n, width, dtype=torch.int64),
        loss_mask=loss_mask,
        old_logprobs=torch.full((n, width - 1), -float(torch.log(torch.tensor(vocab)))) * loss_mask,
        advantages=advantages,
        temperature=torch.ones(n),
        rewards=(torch.arange(n) % 2 == 0).float(),
        lengths=torch.full((n,), width, dtype=torch.int64),
    )


def open_process_group(device: str) -> int:
    """The default process group the learner shards over; returns the world size. Under
    torchrun (``WORLD_SIZE`` > 1) the learner's own :func:`learner.distributed.init_from_env`;
    otherwise one rank on an in-memory store (no port, no file): NCCL on CUDA, gloo on CPU."""
    import torch.distributed as dist

    from streamrl.learner import distributed as dist_util

    if dist_util.init_from_env():
        return dist.get_world_size()
    if not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return 1


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return str(torch.cuda.get_device_name())
    import platform

    return platform.processor() or platform.machine() or "cpu"


class Report:
    """A part's figures, written to ``path`` as one JSON object after every :meth:`update`
    (to a temporary file, then renamed), so what was measured before a timeout or a crash
    survives it. Only rank 0 writes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {}

    def update(self, **figures: Any) -> None:
        self.data.update(figures)
        if rank() != 0:
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data))
        tmp.replace(self.path)
