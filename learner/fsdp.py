"""Fully sharded data parallel (FSDP2, ``torch.distributed.fsdp.fully_shard``) for the learner,
its sharded checkpoints and its full Hugging Face export.

Guarantees:
- :func:`shard` wraps each decoder layer (the model's ``_no_split_modules``) and then the root
  in ``fully_shard``: at rest every rank holds ``1 / world`` of each parameter, of its
  gradient and of its AdamW moments (DTensors sharded on dim 0); a layer's parameters are
  all-gathered for its forward and its backward only, and its gradients reduce-scattered
  right after its backward;
- mixed precision (:func:`mixed_precision`): bf16 parameters in the forward and backward with
  fp32 gradient reduction and fp32 sharded master weights (CUDA with ``bf16``); fp32
  throughout on CPU;
- :func:`clip_grad_norm_` is the global norm over every rank's shards (the partial norms are
  summed across ranks before clipping), so clipping is the one of a single process;
- :func:`save_sharded` writes model and optimiser with ``torch.distributed.checkpoint`` (each
  rank its shards, one directory on a disk every rank sees); :func:`load_sharded` reads it
  into any world size, one process without a process group included;
- :func:`full_state_dict` gathers the whole model on rank 0 (CPU, fp32, Hugging Face names)
  and :func:`publish` writes it through :func:`learner.weights.save_weights`: the same
  atomic version directory the inference servers load, whatever the parallelism.

Every function here that takes a sharded model is a collective: every rank calls it, in the
same order. The loss normalisation is the DDP path's (:mod:`learner.distributed`): FSDP's
reduce-scatter averages over ranks, so each rank scales its loss by the world size.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from streamrl.learner.weights import list_versions, save_weights, version_dir

SHARDED_DIR = "sharded"
"""In a version directory: the ``torch.distributed.checkpoint`` of model and optimiser."""
STEPS_FILE = "sharded_steps.pt"
"""In a version directory: the step count and rank 0's RNG states (rank 0 writes it)."""


def mixed_precision(device: torch.device, bf16: bool) -> MixedPrecisionPolicy:
    """bf16 compute with fp32 reduction on CUDA (when ``bf16``), fp32 otherwise."""
    if bf16 and device.type == "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The model's transformer blocks: modules whose class is in ``_no_split_modules``."""
    kinds = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in kinds]
    if not layers:
        raise ValueError(f"{type(model).__name__}: no decoder layer found ({sorted(kinds)})")
    return layers


def shard(root: torch.nn.Module, model: Any, policy: MixedPrecisionPolicy) -> torch.nn.Module:
    """``fully_shard`` each decoder layer of ``model``, then ``root`` (a module whose forward
    runs ``model``: the embeddings, final norm and output head go in the root's group, and
    the root's forward hook gathers them). Call after activation checkpointing is enabled
    and before the optimiser is built (the parameters become DTensors). Every rank must
    hold the same weights (each loads the same directory)."""
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=policy)
    sharded = fully_shard(root, mp_policy=policy)
    assert isinstance(sharded, FSDPModule)  # and still ``root``, its class now FSDP's subclass
    return root


def clip_grad_norm_(params: Iterable[torch.nn.Parameter], max_norm: float) -> float:
    """Clip to the global gradient norm and return it (before clipping). On DTensor
    gradients the norm of the local shards is a partial value; ``full_tensor`` sums the
    squares over ranks, so every rank clips by the norm of the whole gradient."""
    params = [p for p in params if p.grad is not None]
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return float(total)


def full_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """The whole model's state dict (Hugging Face names) on rank 0, on CPU; ``{}`` on the
    other ranks. A collective on a sharded model; a plain copy otherwise."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def export_model(model: Any, state: dict[str, Any]) -> Any:
    """A plain CPU Hugging Face model of ``model``'s config holding ``state``, built on the
    meta device (no random init), for ``save_pretrained`` only (its non-persistent buffers,
    such as rotary frequencies, are left uninitialised: they are not saved)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
    plain.to_empty(device="cpu")
    plain.tie_weights()  # to_empty gave each name of a tied weight a tensor of its own
    plain.load_state_dict(state, strict=True)
    return plain.eval()


def publish(
    model: Any,
    tokenizer: Path | str | Any,
    root: Path,
    version: int,
    keep_last: int,
    extra: Callable[[Path], None] | None = None,
) -> Path | None:
    """Gather ``model`` and write it as ``root/v{version:06d}`` with
    :func:`learner.weights.save_weights` on rank 0 (returns the path there, None on the
    other ranks). A collective: every rank calls it."""
    state = full_state_dict(model)
    path = None
    if _rank() == 0:
        path = save_weights(export_model(model, state), tokenizer, root, version, keep_last, extra)
    _barrier()
    return path


def save_sharded(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path,
    steps: int = 0, rng: dict[str, Any] | None = None,
) -> None:  # fmt: skip
    """Model and optimiser state as a ``torch.distributed.checkpoint`` under
    ``directory/sharded`` (every rank writes its shards; the directory must be one that
    every rank sees), plus the step count and rank 0's RNG states. A collective."""
    directory = Path(directory)
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=directory / SHARDED_DIR)
    if _rank() == 0:
        extra: dict[str, Any] = {"steps": steps}
        if rng is not None:
            extra["rng"] = rng
        torch.save(extra, directory / STEPS_FILE)
    _barrier()


def load_sharded(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path
) -> dict[str, Any]:
    """Load :func:`save_sharded`'s checkpoint into ``model`` and ``optimizer``, sharded or
    not, on any number of ranks (DCP reshards). Returns ``{"steps": ..., "rng": ...}``."""
    directory = Path(directory)
    model_state, optim_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=directory / SHARDED_DIR)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    extra: dict[str, Any] = torch.load(directory / STEPS_FILE, map_location="cpu",
                                       weights_only=True)  # fmt: skip
    return extra


def move_sharded(source: Path, target: Path) -> None:
    """Move a checkpoint written by :func:`save_sharded` into ``target`` (a version
    directory being assembled by :func:`learner.weights.save_weights`)."""
    for name in (SHARDED_DIR, STEPS_FILE):
        shutil.move(str(Path(source) / name), str(Path(target) / name))


class ShardedSnapshot:
    """The FSDP counterpart of :class:`learner.checkpoint.Snapshot`, taken by every rank after
    each step (:meth:`take` is a collective): the whole weights gathered into one CPU model
    on rank 0 (:attr:`model`, for :func:`learner.weights.save_weights`), and, with an
    optimiser, model and optimiser written as a sharded checkpoint by every rank into
    ``root/.sharded`` (a disk every rank sees), which rank 0 then moves into the version
    directory it assembles (:meth:`move_into`). One snapshot at a time: the next
    :meth:`take` clears the staging directory."""

    def __init__(self, root: Path) -> None:
        self.staging = Path(root) / ".sharded"
        self.model: Any = None  # rank 0 only

    def take(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, steps: int,
        rng: dict[str, Any] | None,
    ) -> None:  # fmt: skip
        state = full_state_dict(model)
        if _rank() == 0:
            if self.model is None:
                self.model = export_model(model, state)
            else:
                self.model.load_state_dict(state, strict=True)
            shutil.rmtree(self.staging, ignore_errors=True)
        _barrier()  # the staging directory is empty before any rank writes into it
        if optimizer is not None:
            save_sharded(model, optimizer, self.staging, steps, rng)

    def move_into(self, directory: Path) -> None:
        """Rank 0: the staged sharded checkpoint (if one was taken) into ``directory``."""
        if (self.staging / SHARDED_DIR).is_dir():
            move_sharded(self.staging, directory)


def prune_sharded(root: Path, keep: int) -> None:
    """Delete the sharded checkpoint of every version but ``keep`` (the newest resumes)."""
    for version in list_versions(root):
        if version != keep:
            shutil.rmtree(version_dir(root, version) / SHARDED_DIR, ignore_errors=True)
            (version_dir(root, version) / STEPS_FILE).unlink(missing_ok=True)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
