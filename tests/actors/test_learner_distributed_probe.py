"""A distributed learner never probes a failing group on rank 0 alone: a probe step's
collectives (DDP's all-reduce, FSDP's all-gathers) would wait for ranks that only take the
steps rank 0 broadcasts, so the ranks would sit in different collectives for ever. It fails
loudly instead (the runtime re-raises the step's failure); one process still isolates."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import trio

from streamrl.actors.learner import Learner


class _Failed(Exception):
    pass


class _Batches:
    """Stands in for the batch runtime: records the probe it is given, then fails the step."""

    def __init__(self) -> None:
        self.probes: list[Any] = []

    async def handle(self, batch: Any, step: Any, probe: Any = None) -> Any:
        self.probes.append(probe)
        raise _Failed


def _learner(distributed: bool) -> Learner:
    learner = Learner.__new__(Learner)  # no trainer, no Redis: only what _train reads first
    learner.distributed = distributed
    learner.cfg = SimpleNamespace(max_steps=0, step_without_signal=False)  # type: ignore[assignment]
    learner.version = 0
    learner.batches = _Batches()  # type: ignore[assignment]
    return learner


@pytest.mark.parametrize("distributed", [True, False], ids=["torchrun", "one-process"])
async def test_a_failing_step_is_probed_only_in_one_process(distributed: bool) -> None:
    # Given a learner whose step fails on its batch
    learner = _learner(distributed)
    send, receive = trio.open_memory_channel[Any](1)
    await send.send([object()])
    # When it trains on it
    with pytest.RaisesGroup(_Failed, flatten_subgroups=True):
        await learner._train(receive)
    # Then the runtime is given a probe in one process only
    [probe] = learner.batches.probes  # type: ignore[attr-defined]
    if distributed:
        assert probe is None
    else:
        assert probe == learner._probe
