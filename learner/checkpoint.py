"""What a learner checkpoint holds besides the weights: the consumed-groups ledger and the
optimiser state.

A checkpoint is the version directory ``root/v{N:06d}`` (see :mod:`learner.weights`) plus
the first N lines of the ledger ``root/consumed.jsonl``. Write order per step:

1. append the step's line ``{"version": N, "episode_ids": [...], "trajectory_ids": [...],
   "entry_ids": [...]}`` to the ledger and fsync it;
2. write ``v{N:06d}`` (weights, tokenizer, ``trainer_state.pt``) atomically.

So a crash between 1 and 2 leaves a ledger line whose version has no weights: it is void
and :meth:`Ledger.open` cuts it off. A crash after 2 leaves a complete checkpoint whose
ledger knows every group trained into it. A restarted learner therefore never trains a
group twice (its episode id is in the ledger: the redelivered entry is only acknowledged)
and never skips one (a group is in the ledger only if its step's weights exist; groups of
a void step are still pending in Redis and get redelivered).

``trainer_state.pt`` holds the AdamW moments, the step count and the RNG states; only the
newest version keeps it (it is twice the size of the weights), older versions keep only the weights.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from streamrl.learner.weights import list_versions, version_dir

LEDGER_FILE = "consumed.jsonl"
TRAINER_STATE_FILE = "trainer_state.pt"


@dataclass(frozen=True)
class StepRecord:
    version: int
    episode_ids: list[str]
    trajectory_ids: list[str] = field(default_factory=list)
    entry_ids: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": self.version,
                "episode_ids": self.episode_ids,
                "trajectory_ids": self.trajectory_ids,
                "entry_ids": self.entry_ids,
            },
            separators=(",", ":"),
        )


class LedgerError(RuntimeError):
    pass


class Ledger:
    """The episode ids trained into each policy version, append-only, one line per step."""

    def __init__(self, path: Path, records: list[StepRecord]) -> None:
        self.path = path
        self.records = records
        self.consumed: set[str] = {e for r in records for e in r.episode_ids}

    @classmethod
    def open(cls, root: Path, latest: int) -> Ledger:
        """Read the ledger of ``root``; lines of versions above ``latest`` (steps whose
        weights were never completed) are void and removed from the file."""
        path = Path(root) / LEDGER_FILE
        records: list[StepRecord] = []
        if path.exists():
            lines = path.read_bytes().split(b"\n")
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    raw = json.loads(line)
                    record = StepRecord(
                        version=int(raw["version"]),
                        episode_ids=[str(e) for e in raw["episode_ids"]],
                        trajectory_ids=[str(t) for t in raw.get("trajectory_ids", [])],
                        entry_ids=[str(e) for e in raw.get("entry_ids", [])],
                    )
                except (ValueError, KeyError, TypeError) as exc:
                    if number == len(lines) or all(not x.strip() for x in lines[number:]):
                        break  # a torn last line: the crash hit the append itself
                    raise LedgerError(f"{path}:{number}: corrupt ledger line: {exc}") from None
                if record.version <= latest:
                    records.append(record)
            versions = [r.version for r in records]
            if versions != sorted(set(versions)):
                raise LedgerError(f"{path}: versions out of order or repeated: {versions[-5:]}")
            kept = "".join(r.to_json() + "\n" for r in records).encode()
            if kept != path.read_bytes():
                _atomic_write(path, kept)
        return cls(path, records)

    def __contains__(self, episode_id: str) -> bool:
        return episode_id in self.consumed

    def last(self) -> StepRecord | None:
        return self.records[-1] if self.records else None

    def append(self, record: StepRecord) -> None:
        """Durably record a step before its weights are written."""
        if self.records and record.version <= self.records[-1].version:
            raise LedgerError(
                f"version {record.version} after {self.records[-1].version}: ledger is ordered"
            )
        again = self.consumed.intersection(record.episode_ids)
        if again or len(set(record.episode_ids)) != len(record.episode_ids):
            raise LedgerError(f"episodes trained twice: {sorted(again)[:5]}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "ab") as f:
            f.write(record.to_json().encode() + b"\n")
            f.flush()
            os.fsync(f.fileno())
        self.records.append(record)
        self.consumed.update(record.episode_ids)


def save_trainer_state(
    optimizer: torch.optim.Optimizer,
    steps: int,
    directory: Path,
    rng: dict[str, Any] | None = None,
) -> None:
    """AdamW state, step count and (optionally) the RNG states of
    :func:`learner.train.rng_state`; everything loads with ``weights_only=True``."""
    state: dict[str, Any] = {"optimizer": optimizer.state_dict(), "steps": steps}
    if rng is not None:
        state["rng"] = rng
    torch.save(state, Path(directory) / TRAINER_STATE_FILE)


def save_state_dict(state: dict[str, Any], directory: Path) -> None:
    """Write a ready trainer state (e.g. :meth:`Snapshot.take`'s) as ``trainer_state.pt``."""
    torch.save(state, Path(directory) / TRAINER_STATE_FILE)


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return copy.deepcopy(value)


class Snapshot:
    """A host copy of the policy taken right after a step, so that its checkpoint can be
    written while the next step already changes the live model (the learner stays busy).

    One shadow model is allocated once (a CPU copy of the policy, tied weights still tied)
    and overwritten by each :meth:`take`; a take must wait until the previous snapshot has
    been written. Host memory: one more copy of the weights, plus one of the AdamW state
    when it is checkpointed.
    """

    def __init__(self, model: Any) -> None:
        self.model = copy.deepcopy(model).to("cpu").eval().requires_grad_(False)

    def take(
        self, model: Any, optimizer: torch.optim.Optimizer | None, steps: int, rng: Any
    ) -> dict[str, Any] | None:
        """Copy the weights into the shadow model; return the trainer state to save (None
        without an optimiser)."""
        with torch.no_grad():
            live = model.state_dict()
            for name, tensor in self.model.state_dict().items():
                tensor.copy_(live[name])
        if optimizer is None:
            return None
        return {"optimizer": _to_cpu(optimizer.state_dict()), "steps": steps, "rng": rng}


def load_trainer_state(directory: Path) -> dict[str, Any] | None:
    path = Path(directory) / TRAINER_STATE_FILE
    if not path.exists():
        return None
    state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    return state


def prune_trainer_states(root: Path, keep: int) -> None:
    """Delete ``trainer_state.pt`` from every version but ``keep``."""
    for v in list_versions(root):
        if v != keep:
            (version_dir(root, v) / TRAINER_STATE_FILE).unlink(missing_ok=True)


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.rename(path)
