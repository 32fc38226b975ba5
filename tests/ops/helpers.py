"""Real pipeline messages for the operations tests: arith episodes as the stages make them."""

from __future__ import annotations

from pathlib import Path

from streamrl.config.schema import Config
from streamrl.protocol.messages import (
    ExecOutcome,
    Executed,
    Rollout,
    Sample,
    Sampling,
    Task,
    floats_to_bytes,
    ids_to_bytes,
    new_id,
    now,
)
from tests.helpers import run_config


def config(tmp_path: Path, redis_url: str, run: str, *overrides: str) -> Config:
    return run_config(
        tmp_path,
        redis_url,
        run,
        "model.spec=tiny",
        "queues.block_ms=100",
        "queues.reclaim_interval_s=0.2",
        "retry.backoff_s=0.01",
        *overrides,
    )


def outcome(stdout: str, exit_code: int = 0, stderr: str = "") -> ExecOutcome:
    return ExecOutcome(
        exit_code=exit_code, stdout=stdout, stderr=stderr, timed_out=False, oom_killed=False,
        duration_s=0.01,
    )


def executed(
    answer: str,
    outputs: list[str],
    *,
    stderr: str = "",
    policy_version: int = 0,
    split: str = "train",
    item_id: str = "arith-train-x",
) -> Executed:
    """An arith group whose samples printed ``outputs`` (the right answer is ``answer``)."""
    task = Task(
        id=new_id(),
        created_at=now(),
        policy_version=policy_version,
        domain="arith",
        item_id=item_id,
        split=split,
        prompt=f"Write a Python program that prints {answer}.",
        spec={"id": item_id, "prompt": "p", "answer": answer, "kind": "literal"},
        group_size=len(outputs),
        sampling=Sampling(max_new_tokens=8, temperature=1.0),
    )
    samples = [
        Sample(
            tokens=ids_to_bytes([10 + i, 11, 12]),
            logprobs=floats_to_bytes([-1.0, -0.5, -0.25]),
            text=f"```python\nprint({out!r})\n```",
            finish_reason="stop",
            weight_version=policy_version,
        )
        for i, out in enumerate(outputs)
    ]
    rollout = Rollout(
        id=new_id(), created_at=now(), policy_version=policy_version, task=task,
        prompt_ids=ids_to_bytes([1, 2, 3]), samples=samples,
    )
    return Executed(
        id=new_id(), created_at=now(), policy_version=policy_version, rollout=rollout,
        outcomes=[outcome(out + "\n", stderr=stderr) for out in outputs],
    )
