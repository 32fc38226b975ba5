"""Multi-turn episodes on SGLang-protocol servers (two real ``streamrl serve-model``
processes with the tiny model): every turn of an episode is sent with the episode id as its
session, so the client keeps the episode on the server that has its prefix cached."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from streamrl.actors.generator import Generator
from streamrl.actors.scheduler import make_task
from streamrl.inference.sglang_client import open_sglang_engine
from streamrl.models import load_tokenizer, resolve_model
from streamrl.protocol import names as N
from streamrl.protocol.messages import Sampling
from streamrl.testing.serve_model import start_serve_model, wait_healthy
from tests.actors.test_multiturn import executor
from tests.domains.test_terminal import item_of


@pytest.mark.system
async def test_every_turn_of_an_episode_stays_on_its_server(tmp_path: Path) -> None:
    tokenizer: Any = load_tokenizer(resolve_model("tiny"))
    servers = [start_serve_model(tmp_path) for _ in range(2)]
    try:
        for s in servers:
            await trio.to_thread.run_sync(wait_healthy, s)
        async with open_sglang_engine([s.url for s in servers]) as engine:
            generator, ex = Generator(engine, tokenizer), executor(turns=3)
            items = [item_of("count_matching"), item_of("sum_column")]
            tasks = [make_task("terminal", it, split="train", group_size=2,
                               sampling=Sampling(max_new_tokens=8, temperature=1.0), version=0)
                     for it in items]
            episodes = [t.id for t in tasks]
            placed: dict[str, list[str]] = {e: [] for e in episodes}

            async def play(task: Any) -> None:
                while True:  # the loop the streams run, turn by turn
                    [rollout] = await generator.handle(task)
                    episode = rollout.message.episode_id
                    placed[episode].append(engine._sticky[episode].url)
                    [out] = await ex.handle(rollout.message)  # type: ignore[arg-type]
                    if out.stream == N.EXECUTED:
                        return
                    task = out.message

            async with ex.sandboxes.opened():
                try:
                    async with trio.open_nursery() as nursery:  # both episodes at once
                        for t in tasks:
                            nursery.start_soon(play, t)
                finally:
                    await ex.sessions.aclose()
            sessions = set(engine._sticky)
    finally:
        for s in servers:
            s.kill()
    # Then each episode had one session, its id, and every turn went to one server
    assert sessions == set(episodes)
    for e in episodes:
        assert len(placed[e]) == 3 and len(set(placed[e])) == 1, placed
    # (the least-loaded pick spread the two concurrent episodes over both servers)
    assert {placed[e][0] for e in episodes} == {s.url for s in servers}
