"""Data-parallel training across processes launched by ``torchrun`` (gloo on CPU, NCCL on GPU).

Design (one reader, many trainers):
- rank 0 is the only rank that talks to Redis: it reads the step's groups, applies the
  staleness and ledger policies, and sends the accepted groups to every rank as their
  MessagePack encoding (:func:`broadcast_payloads`: a length tensor, then one ``uint8``
  tensor; no pickle). Every rank builds the same :class:`~learner.batch.Batch` from them;
- each rank trains on its contiguous slice of the samples (:func:`shard_rows`); every
  micro-batch divides by the token count of the *whole* batch, so summing the gradients
  over ranks (:func:`all_reduce_grads`, one flat ``all_reduce(SUM)`` per dtype) gives
  exactly the gradient of one process on the whole batch. Clipping and the AdamW step then
  run on identical gradients on every rank, which keeps the replicas identical;
- only rank 0 writes the ledger, the weights and the optimiser state, and publishes.

This is what ``DistributedDataParallel`` does (its bucketed all-reduce averages instead of
summing), written out so that ranks may run different numbers of micro-batches (a shard of
a batch that does not divide evenly) without DDP's "every rank runs the same backward
passes" rule. Everything here is a no-op in a single process without a process group.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def init_from_env() -> bool:
    """Initialise the default process group from torchrun's environment (``WORLD_SIZE`` >
    1); gloo on CPU, NCCL when CUDA is available. Returns whether it is distributed."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    return True


def shard_rows(n: int) -> slice:
    """This rank's contiguous slice of ``n`` samples (sizes differ by at most one)."""
    world, r = world_size(), rank()
    base, extra = divmod(n, world)
    start = r * base + min(r, extra)
    return slice(start, start + base + (1 if r < extra else 0))


def _device_of(model: Any) -> torch.device:
    return next(model.parameters()).device


def broadcast_parameters(model: Any) -> None:
    """Every rank starts from rank 0's weights (as DDP does at construction)."""
    if not is_distributed():
        return
    with torch.no_grad():
        for tensor in model.state_dict().values():
            dist.broadcast(tensor, src=0)


def all_reduce_grads(model: Any) -> None:
    """Sum the gradients of every parameter over the ranks (a missing gradient counts as
    zero: a rank with an empty shard still takes part)."""
    if not is_distributed():
        return
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """Element-wise sum over the ranks of a small statistics tensor."""
    if not is_distributed():
        return values
    backend_device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    out = values.to(backend_device)
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out.cpu()


def broadcast_payloads(payloads: Sequence[bytes] | None) -> list[bytes]:
    """Rank 0 passes the step's encoded groups, the other ranks ``None``; every rank gets
    rank 0's list back."""
    if not is_distributed():
        return list(payloads or [])
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    if rank() == 0:
        assert payloads is not None
        sizes = torch.tensor([len(p) for p in payloads], dtype=torch.int64)
        count = torch.tensor([len(payloads)], dtype=torch.int64, device=device)
    else:
        count = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(count, src=0)
    if rank() != 0:
        sizes = torch.zeros(int(count.item()), dtype=torch.int64)
    sizes = sizes.to(device)
    dist.broadcast(sizes, src=0)
    total = int(sizes.sum().item())
    if rank() == 0:
        assert payloads is not None
        data = (
            torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8)
            if total
            else (torch.zeros(0, dtype=torch.uint8))
        )
        data = data.to(device)
    else:
        data = torch.zeros(total, dtype=torch.uint8, device=device)
    if total:
        dist.broadcast(data, src=0)
    raw = data.cpu().numpy().tobytes()
    out, offset = [], 0
    for size in sizes.cpu().tolist():
        out.append(raw[offset : offset + size])
        offset += size
    return out
