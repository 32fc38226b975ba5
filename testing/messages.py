"""Messages for tests and benchmarks, built from plain lists."""

from __future__ import annotations

from collections.abc import Sequence

from streamrl.protocol.messages import (
    Rollout,
    Sample,
    Sampling,
    Task,
    Trajectory,
    floats_to_bytes,
    ids_to_bytes,
    new_id,
    now,
)


def make_trajectory(
    prompt_ids: Sequence[int],
    completions: Sequence[Sequence[int]],
    logprobs: Sequence[Sequence[float]],
    rewards: Sequence[float],
    *,
    weight_versions: Sequence[int] | int = 0,
    temperature: float = 1.0,
    policy_version: int = 0,
    masks: Sequence[Sequence[int]] | None = None,
) -> Trajectory:
    """A well-formed ``Trajectory`` from plain lists, for tests and benchmarks.

    Only the fields the learner reads carry meaning; the rest (domain, texts, outcomes) are
    placeholders.
    """
    if isinstance(weight_versions, int):
        weight_versions = [weight_versions] * len(completions)
    mask_bytes = [bytes(bytearray(m)) for m in masks] if masks else [b""] * len(completions)
    task = Task(
        id=new_id(),
        created_at=now(),
        policy_version=policy_version,
        domain="synthetic",
        item_id="item-0",
        split="train",
        prompt="",
        spec={},
        group_size=len(completions),
        sampling=Sampling(temperature=temperature),
    )
    samples = [
        Sample(
            tokens=ids_to_bytes(tokens),
            logprobs=floats_to_bytes(lps),
            text="",
            finish_reason="stop",
            weight_version=version,
            mask=mask,
        )
        for tokens, lps, version, mask in zip(
            completions, logprobs, weight_versions, mask_bytes, strict=True
        )
    ]
    rollout = Rollout(
        id=new_id(),
        created_at=now(),
        policy_version=policy_version,
        task=task,
        prompt_ids=ids_to_bytes(prompt_ids),
        samples=samples,
    )
    return Trajectory(
        id=new_id(),
        created_at=now(),
        policy_version=policy_version,
        rollout=rollout,
        outcomes=[],
        rewards=list(rewards),
    )
