"""Run by ``torchrun`` from test_fsdp.py: every case of ``PATTERN_CASES`` under FSDP2, whose
ranks' micro-batches do not all take the same forward (one rank's rows share a long prompt,
the other's do not, or it has a single row); rank 0 saves the gathered weights and the step
statistics of each case as ``patterns-<case>.pt``."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from streamrl.learner import distributed as dist_util
from streamrl.learner import fsdp
from streamrl.models import load_model, resolve_model
from tests.learner.test_fsdp import PATTERN_CASES, run_pattern_case


def main(out: Path) -> None:
    assert dist_util.init_from_env()
    for case in PATTERN_CASES:
        trainer, stats = run_pattern_case(case, load_model(resolve_model("tiny")), "fsdp")
        assert trainer.fsdp is not None
        full = fsdp.full_state_dict(trainer.model)
        if dist_util.rank() == 0:
            torch.save({"state": full, "loss": stats.loss, "grad_norm": stats.grad_norm,
                        "tokens": stats.tokens, "kl_ref": stats.kl_ref},
                       out / f"patterns-{case}.pt")  # fmt: skip
    dist_util.teardown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
