"""Data-parallel training across processes launched by ``torchrun`` (gloo on CPU, NCCL on
GPU), on torch's :class:`~torch.nn.parallel.DistributedDataParallel`.

Design (one reader, many trainers):
- rank 0 is the only rank that talks to Redis: it reads the step's groups, applies the
  staleness and ledger policies, and sends the accepted groups to every rank as their
  MessagePack encoding (:func:`broadcast_payloads`: a length tensor, then one ``uint8``
  tensor; no pickle). Every rank builds the same :class:`~learner.batch.Batch` from them;
- the :class:`~learner.train.Trainer` wraps its policy in DDP (:func:`wrap_ddp`; the
  constructor broadcasts rank 0's weights). Each rank trains on its contiguous slice of
  the samples (:func:`shard_rows`), in micro-batches under ``no_sync()`` except the last,
  whose backward runs DDP's bucketed all-reduce of the accumulated gradients;
- uneven shards: DDP needs every rank to run the same backward passes. All ranks hold the
  whole batch, so each computes every rank's shard and the largest micro-batch count
  without communicating; a rank with fewer micro-batches (or an empty shard, when there
  are fewer samples than ranks) runs padding micro-batches whose loss is multiplied by 0;
- every micro-batch's loss divides by the token count of the *whole* batch, and DDP
  *averages* gradients over ranks, so each rank scales its loss by the world size: the
  all-reduced gradient is exactly the gradient of one process on the whole batch (up to
  float summation order). Clipping and the AdamW step then run on identical gradients on
  every rank, which keeps the replicas identical;
- only rank 0 writes the ledger, the weights and the optimiser state, and publishes.

Under DDP the model, its gradients and AdamW state must fit on one device (``parallelism =
"fsdp"`` shards them: :mod:`learner.fsdp`, the same batch split and padding passes). Everything
here is a no-op in a single process without a process group (the Trainer then does not wrap).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def is_distributed() -> bool:
    return in_process_group() and dist.get_world_size() > 1


def in_process_group() -> bool:
    """A default process group exists, of any size (one rank included: FSDP2 then gives one
    device bf16 parameters over fp32 master weights, see :class:`learner.train.Trainer`)."""
    return dist.is_available() and dist.is_initialized()


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


def teardown() -> None:
    """Destroy the default group, every rank together: a barrier first, because a gloo rank
    whose peer already closed its connections can abort in its IO thread while it destroys
    its own group ("terminate called without an active exception", SIGABRT; seen in CI under
    load after the last collective). Call it where no rank can still be inside a collective
    that the others skip (the learner actor, ``actors/learner.py``, waits for rank 0's
    release first)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def shard_rows(n: int, of_rank: int | None = None) -> slice:
    """Rank ``of_rank``'s (default: this rank's) contiguous slice of ``n`` samples; the
    sizes differ by at most one, and a rank gets an empty slice when ``n < world``. Every
    rank can compute every rank's slice without communication."""
    world, r = world_size(), rank() if of_rank is None else of_rank
    base, extra = divmod(n, world)
    start = r * base + min(r, extra)
    return slice(start, start + base + (1 if r < extra else 0))


def wrap_ddp(module: torch.nn.Module, device: torch.device) -> DistributedDataParallel:
    """``module`` in :class:`~torch.nn.parallel.DistributedDataParallel` (call only when
    :func:`is_distributed`). The constructor broadcasts rank 0's parameters and buffers, so
    every replica starts identical. CPU/gloo: no ``device_ids``; CUDA: the module's device.
    Buffers are not re-broadcast before each forward (``broadcast_buffers=False``): a causal
    LM's buffers (rotary frequencies) are constants, and a per-forward broadcast would only
    add a collective."""
    device_ids = None
    if device.type == "cuda":
        device_ids = [device.index if device.index is not None else torch.cuda.current_device()]
    return DistributedDataParallel(module, device_ids=device_ids, broadcast_buffers=False)


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
