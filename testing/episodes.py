"""Long multi-turn episodes for tests and benchmarks of the wire (context by reference).

:class:`BulkEngine` answers every member with ``tokens`` synthetic tokens per turn,
deterministic in the context it is given (so two runs of one episode produce the same
tokens), never a shell command: the turns cost no sandbox time, only the context grows.
:func:`bulk_domain` registers a terminal-like multi-turn domain of ``turns`` turns with no
token budget. :class:`WireMeter` counts what each hand-off writes (its payloads and stored
context parts) per turn; :func:`play_in_process` plays an episode through the handlers
alone, passing whole messages (the wire before context by reference), for comparison.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import numpy as np

from streamrl.domains import registry
from streamrl.domains.base import EpisodePolicy
from streamrl.domains.terminal import Terminal
from streamrl.inference.engine import Completion
from streamrl.protocol import names as N
from streamrl.protocol.messages import Executed, Rollout, Sampling, Task
from streamrl.queues.codec import encode
from streamrl.queues.streams import Handoff

MARK = 7  # every reply starts with this token: the turn is read off the prompt


class BulkEngine:
    def __init__(self, tokens: int, hold_turn: int = 0) -> None:
        import trio

        self.tokens = tokens
        self.hold_turn = hold_turn
        self.release = trio.Event()
        self.calls = 0

    @property
    def weight_version(self) -> int:
        return 0

    async def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Completion]:
        self.calls += 1
        turn = int(np.count_nonzero(np.asarray(prompts[0]) == MARK)) + 1
        if turn == self.hold_turn:
            await self.release.wait()
        out = []
        for i, prompt in enumerate(prompts):
            rng = np.random.default_rng([len(prompt), i, int(np.sum(prompt[-64:]))])
            ids = rng.integers(20, 1000, self.tokens).astype(np.int32)
            ids[0] = MARK
            logprobs = rng.uniform(-3, 0, self.tokens).astype(np.float32)
            out.append(Completion(tokens=ids, logprobs=logprobs, text=f"turn {turn}",
                                  finish_reason="stop", weight_version=0))
        return out

    async def update_weights(self, path: Any, version: int) -> None:
        pass


@contextmanager
def bulk_domain(turns: int, name: str = "bulk_episode_test") -> Iterator[str]:
    class Bulk(Terminal):
        episode = EpisodePolicy(multi_turn=True, max_turns=turns, max_total_tokens=0)

    Bulk.name = name
    registry.register(name)(Bulk)
    try:
        yield name
    finally:
        registry._factories.pop(name, None)
        registry._instances.pop(name, None)


class WireMeter:
    """Bytes each turn's hand-offs write: ``turns[k]`` = the generator's (rollout k) and the
    executor's (the next task, or the episode's end, and the stored part) for turn k;
    ``final``: the verifier's (the whole trajectory, once)."""

    def __init__(self) -> None:
        self.turns: dict[int, int] = defaultdict(int)
        self.final = 0
        self.largest = 0  # the largest single payload or part

    def wrap(self, consumer: Any) -> None:
        complete = consumer.complete

        async def metered(handoff: Handoff) -> None:
            self.count(handoff)
            await complete(handoff)

        consumer.complete = metered

    def count(self, handoff: Handoff) -> None:
        sizes = [len(p) for _, p in handoff.outputs] + [len(v) for _, _, v in handoff.stores]
        self.largest = max([self.largest, *sizes])
        turn = None
        for stream, payload in handoff.outputs:
            if stream.endswith(":s:" + N.ROLLOUTS):
                ep = msgspec.msgpack.decode(payload, type=Rollout).task.episode
            elif stream.endswith(":s:" + N.TASKS):
                ep = msgspec.msgpack.decode(payload, type=Task).episode
            elif stream.endswith(":s:" + N.EXECUTED):
                ep = msgspec.msgpack.decode(payload, type=Executed).rollout.task.episode
            else:
                continue
            turn = ep.turn if ep is not None else 0
        if turn is None:
            self.final += sum(sizes)
        else:
            self.turns[turn] += sum(sizes)


async def play_in_process(generator: Any, executor: Any, task: Task,
                          turns: int) -> tuple[Executed, dict[int, int]]:
    """The episode through the handlers alone, whole messages between them (the wire before
    context by reference); with the bytes each turn's whole messages take encoded."""
    sizes: dict[int, int] = defaultdict(int)
    for turn in range(1, turns + 1):
        [rollout] = await generator.handle(task)
        sizes[turn] += len(encode(rollout.message))
        [out] = await executor.handle(rollout.message)
        sizes[turn] += len(encode(out.message))
        if out.stream == N.EXECUTED:
            return out.message, sizes
        task = out.message
    raise AssertionError(f"episode not over after {turns} turns")
