"""LoRA adapters on the policy with ``peft``: what trains, what a checkpoint holds, what is
published.

Guarantees:
- :func:`apply_lora` freezes every base parameter and injects trainable LoRA layers into the
  Hugging Face model *in place* (``peft.get_peft_model``): the model keeps its forward, so the
  trainer computes logprobs through it unchanged, and only the adapters ever get a gradient
  or AdamW state;
- the reference policy of the KL penalty is the same model with its adapters switched off
  (``PeftModel.disable_adapter()``), the base as loaded: no second copy of the weights;
- a LoRA version directory always holds the adapter (``adapter_model.safetensors`` +
  ``adapter_config.json``, peft's layout, which SGLang loads as a LoRA adapter), from which
  a restarted learner resumes on top of the base model. ``publish = "merged"`` (the default)
  puts a plain Hugging Face model (``W + B A * alpha / r`` for every adapted weight, peft's
  own merge) at the top of the directory, where every engine loads it as before, and the
  adapter in its ``adapter/`` sub-directory (out of reach of engines that read every
  top-level ``*.safetensors``); ``publish = "adapter"`` writes the adapter at the top and no
  full weights;
- :func:`load_adapter` refuses an adapter whose tensor names or shapes do not fit the
  model, before anything is changed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_SUBDIR = "adapter"
"""Where a merged version keeps its adapter (the checkpoint the learner resumes from)."""
ADAPTER_NAME = "default"

Publish = Literal["merged", "adapter"]
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraSettings:
    """Low-rank adapters on the policy: only they train (the base model is frozen)."""

    rank: int = 16
    """Rank ``r`` of each adapter's ``B A`` (>= 1)."""
    alpha: int = 32
    """Scale numerator: the update is ``B A * alpha / rank`` (> 0)."""
    dropout: float = 0.0
    """Dropout on the adapter's input, in [0, 1)."""
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    """Names (last component) of the linear layers that get an adapter; ``("all-linear",)``
    is peft's shortcut for every linear layer but the output head."""
    publish: Publish = "merged"
    """What each version directory offers the generators: the merged Hugging Face model
    (every engine loads it) or the adapter alone (for SGLang's LoRA loading)."""

    def __post_init__(self) -> None:
        checks = {
            "rank >= 1": self.rank >= 1,
            "alpha > 0": self.alpha > 0,
            "0 <= dropout < 1": 0 <= self.dropout < 1,
            "target_modules not empty": len(self.target_modules) > 0,
            "publish in (merged, adapter)": self.publish in ("merged", "adapter"),
        }
        broken = [rule for rule, ok in checks.items() if not ok]
        if broken:
            raise ValueError(f"invalid LoraSettings: {', '.join(broken)}")


def apply_lora(model: Any, settings: LoraSettings) -> Any:
    """Freeze ``model`` and inject the adapters in place; returns the ``PeftModel`` around
    it (``peft_model.base_model.model is model``). Adapter ``A`` is drawn from torch's RNG,
    ``B`` is zero: the policy starts as the base model."""
    from peft import LoraConfig, get_peft_model

    targets: str | list[str] = list(settings.target_modules)
    if targets == ["all-linear"]:
        targets = "all-linear"
    config = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config, adapter_name=ADAPTER_NAME)


def merged_state_dict(peft_model: Any) -> dict[str, Tensor]:
    """The base model's own state dict (its parameter names) with every adapter merged:
    ``W + delta`` where peft's ``merge_and_unload`` would put it, computed on copies (the
    live model is not touched)."""
    from peft.tuners.lora import LoraLayer

    inner = peft_model.get_base_model()
    merged: dict[str, Tensor] = {}
    with torch.no_grad():
        for name, tensor in inner.state_dict().items():
            if ".lora_" in name:
                continue
            merged[name.replace(".base_layer.", ".")] = tensor
        for name, module in inner.named_modules():
            if isinstance(module, LoraLayer) and ADAPTER_NAME in module.lora_A:
                layer: Any = module  # lora.Linear and kin: get_delta_weight
                base = layer.get_base_layer().weight
                merged[f"{name}.weight"] = base + layer.get_delta_weight(ADAPTER_NAME)
    return merged


def save_merged(peft_model: Any, directory: Path) -> None:
    """A plain Hugging Face directory (config, generation config, ``model.safetensors``)
    of the merged model; loads with ``AutoModelForCausalLM`` and no peft."""
    inner = peft_model.get_base_model()
    state = {k: v.detach().to("cpu").contiguous() for k, v in merged_state_dict(peft_model).items()}
    inner.save_pretrained(directory, state_dict=state, safe_serialization=True)


def find_adapter(directory: Path | str) -> Path:
    """The adapter of a LoRA version directory (``adapter/`` of a merged version, or the
    directory itself); ``FileNotFoundError`` if it has none (a full-weights version)."""
    directory = Path(directory)
    for candidate in (directory / ADAPTER_SUBDIR, directory):
        if (candidate / ADAPTER_CONFIG).exists() and (candidate / ADAPTER_WEIGHTS).exists():
            return candidate
    raise FileNotFoundError(f"{directory}: no LoRA adapter ({ADAPTER_CONFIG} + {ADAPTER_WEIGHTS})")


def load_adapter(peft_model: Any, directory: Path | str) -> None:
    """Copy the adapter of ``directory`` (see :func:`find_adapter`) into ``peft_model``'s
    adapters in place (the optimiser keeps pointing at the same parameters)."""
    from safetensors.torch import load_file

    path = find_adapter(directory) / ADAPTER_WEIGHTS
    saved = load_file(str(path))
    suffix = f".{ADAPTER_NAME}.weight"
    own = {
        k: v for k, v in peft_model.state_dict().items() if ".lora_" in k
    }  # e.g. base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight
    wanted = {k.removesuffix(suffix) + ".weight": k for k in own}
    unexpected = set(saved) - set(wanted)
    missing = set(wanted) - set(saved)
    if unexpected or missing or not saved:
        raise KeyError(
            f"{path}: unexpected {sorted(unexpected)[:5]}, missing {sorted(missing)[:5]}"
        )
    for name, tensor in saved.items():
        if tuple(tensor.shape) != tuple(own[wanted[name]].shape):
            raise ValueError(
                f"{path}: {name} has shape {tuple(tensor.shape)}, "
                f"the adapter has {tuple(own[wanted[name]].shape)} (another rank?)"
            )
    with torch.no_grad():
        for name, tensor in saved.items():
            own[wanted[name]].copy_(tensor)


class LoraExport:
    """What :func:`learner.weights.save_weights` writes for a LoRA policy: it calls
    ``save_pretrained(directory)`` on this object (see the module docstring for the
    layout of each ``publish`` mode)."""

    def __init__(self, peft_model: Any, publish: Publish) -> None:
        self.peft_model = peft_model
        self.publish = publish

    def save_pretrained(self, directory: Path | str, safe_serialization: bool = True) -> None:
        directory = Path(directory)
        if self.publish == "merged":
            save_merged(self.peft_model, directory)
            adapter = directory / ADAPTER_SUBDIR
        else:
            adapter = directory
        self.peft_model.save_pretrained(adapter, safe_serialization=safe_serialization)
        (adapter / "README.md").unlink(missing_ok=True)  # peft's model card stub
        if adapter != directory:  # save_weights fsyncs the top level only
            for path in [*adapter.iterdir(), adapter]:
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
