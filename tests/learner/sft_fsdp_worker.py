"""Run by ``torchrun`` from test_sft_fsdp.py: every SFT case under FSDP2; rank 0 saves the
gathered weights and the step statistics of each case as ``sft-<case>.pt``."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from streamrl.learner import distributed as dist_util
from streamrl.learner import fsdp
from streamrl.models import load_model, resolve_model
from tests.learner.test_sft_fsdp import CASES, run_case


def main(out: Path) -> None:
    assert dist_util.init_from_env()
    for case in CASES:
        trainer, stats = run_case(case, load_model(resolve_model("tiny")), "fsdp")
        assert trainer.fsdp is not None
        full = fsdp.full_state_dict(trainer.model)
        if dist_util.rank() == 0:
            torch.save({"state": full, "loss": stats.loss, "grad_norm": stats.grad_norm,
                        "tokens": stats.tokens}, out / f"sft-{case}.pt")  # fmt: skip
    dist_util.teardown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
