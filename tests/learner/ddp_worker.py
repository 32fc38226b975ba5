"""Run by ``torchrun`` from test_distributed.py: every case of ``CASES`` on a fixed batch
that rank 0 broadcasts (MessagePack, as the learner actor does); each rank saves its
weights and step statistics after each case."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from streamrl.learner import distributed as dist_util
from streamrl.models import load_model, resolve_model
from streamrl.protocol.messages import Trajectory
from streamrl.queues.codec import decode, encode
from tests.learner.test_distributed import CASES, fixed_groups, run_case


def main(out: Path) -> None:
    assert dist_util.init_from_env()
    payloads = [encode(t) for t in fixed_groups()] if dist_util.rank() == 0 else None
    groups = [decode(p, Trajectory) for p in dist_util.broadcast_payloads(payloads)]
    for case in CASES:
        trainer, stats = run_case(case, load_model(resolve_model("tiny")), groups)
        assert trainer.ddp is not None
        torch.save({"state": trainer.model.state_dict(), "loss": stats.loss,
                    "grad_norm": stats.grad_norm, "tokens": stats.tokens,
                    "kl_ref": stats.kl_ref},
                   out / f"{case}-rank{dist_util.rank()}.pt")  # fmt: skip
    dist_util.teardown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
