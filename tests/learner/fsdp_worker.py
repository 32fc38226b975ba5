"""Run by ``torchrun`` from test_fsdp.py: every case of ``CASES`` under FSDP2 on a fixed batch
that rank 0 broadcasts; rank 0 saves the gathered weights and the step statistics, every rank
the size of its own shards. After the first case, its trainer writes a sharded checkpoint and
publishes its gathered weights as version 1 (the learner's publish path)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from streamrl.learner import distributed as dist_util
from streamrl.learner import fsdp
from streamrl.models import load_model, resolve_model
from streamrl.protocol.messages import Trajectory
from streamrl.queues.codec import decode, encode
from tests.learner.test_distributed import CASES, fixed_groups
from tests.learner.test_fsdp import run_case


def main(out: Path) -> None:
    assert dist_util.init_from_env()
    rank = dist_util.rank()
    payloads = [encode(t) for t in fixed_groups()] if rank == 0 else None
    groups = [decode(p, Trajectory) for p in dist_util.broadcast_payloads(payloads)]
    staging = out / "staging"
    for case in CASES:
        trainer, stats = run_case(case, load_model(resolve_model("tiny")), groups, "fsdp")
        assert trainer.fsdp is not None and trainer.ddp is None
        full = fsdp.full_state_dict(trainer.model)
        local = sum(p.to_local().numel() for p in trainer.model.parameters())
        torch.save({"local_numel": local}, out / f"{case}-rank{rank}-shard.pt")
        if rank == 0:
            torch.save({"state": full, "loss": stats.loss, "grad_norm": stats.grad_norm,
                        "tokens": stats.tokens, "kl_ref": stats.kl_ref},
                       out / f"{case}.pt")  # fmt: skip
        if case == "uneven":  # the checkpoint to resume from on one rank, and the export
            trainer.save_sharded(staging)
            fsdp.publish(trainer.model, resolve_model("tiny"), out / "weights", 1, keep_last=2,
                         extra=lambda d: fsdp.move_sharded(staging, d))  # fmt: skip
    dist_util.teardown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
