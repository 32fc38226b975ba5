"""Run by ``torchrun`` from test_distributed.py: one Trainer step on a fixed batch that rank 0
broadcasts (MessagePack, as the learner actor does); rank 0 saves the weights after it."""

from __future__ import annotations

import sys

import torch

from learner import distributed as dist_util
from learner.model import load_model, resolve_model
from learner.train import TrainConfig, Trainer
from queues.messages import Trajectory, decode, encode
from tests.learner.test_distributed import fixed_groups


def main(out: str) -> None:
    assert dist_util.init_from_env()
    payloads = [encode(t) for t in fixed_groups()] if dist_util.rank() == 0 else None
    groups = [decode(p, Trajectory) for p in dist_util.broadcast_payloads(payloads)]
    trainer = Trainer(load_model(resolve_model("tiny")), TrainConfig(lr=1e-3, micro_batch_size=2))
    stats = trainer.step(groups)
    if dist_util.rank() == 0:
        torch.save({"state": trainer.model.state_dict(), "loss": stats.loss,
                    "grad_norm": stats.grad_norm, "tokens": stats.tokens}, out)  # fmt: skip
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
