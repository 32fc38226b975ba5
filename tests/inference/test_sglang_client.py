"""SGLangEngine against real ``serve-model`` processes: balancing, stickiness, failover."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import trio

from streamrl.inference.engine import Engine
from streamrl.inference.sglang_client import ServerUnavailable, SGLangEngine, open_sglang_engine
from streamrl.protocol.messages import Sampling
from tests.inference.conftest import ServeModel, start_serve_model, wait_healthy

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356]
GREEDY = Sampling(max_new_tokens=6, temperature=0.0)


def rows_served(server: ServeModel) -> int:
    return int(httpx.get(server.url + "/server_info").json()["internal_states"][0]["rows"])


def test_satisfies_engine_protocol() -> None:
    def accepts(e: Engine) -> None: ...

    async def check() -> None:
        async with httpx.AsyncClient() as client:
            accepts(SGLangEngine(client, ["http://127.0.0.1:1"]))

    trio.run(check)


async def test_balancing_stickiness_failover_and_recovery(
    serve_models: Callable[[int], list[ServeModel]], tmp_path: Path,
) -> None:
    a, b = serve_models(2)  # one pair of processes for the whole story: they start slowly
    async with open_sglang_engine([a.url, b.url], health_interval_s=60) as engine:
        # Given two healthy servers, when 8 calls without a session run at once
        async with trio.open_nursery() as nursery:
            for _ in range(8):
                nursery.start_soon(engine.generate, [PROMPT], Sampling(max_new_tokens=8))
        # Then both servers took some (least-loaded)
        before = rows_served(a), rows_served(b)
        assert min(before) >= 1 and sum(before) == 8
        # When one episode makes 5 sequential calls (a group of 3 each)
        for _ in range(5):
            out = await engine.generate([PROMPT] * 3, GREEDY, session="episode-1")
            assert len(out) == 3 and all(len(c.tokens) == 6 for c in out)
            assert all(c.weight_version == 0 and c.finish_reason == "length" for c in out)
        # Then all 15 rows went to one server
        delta = rows_served(a) - before[0], rows_served(b) - before[1]
        assert sorted(delta) == [0, 15]
        first = await engine.generate([PROMPT], GREEDY, session="episode-1")
        sticky = a if delta[0] else b
        other = b if sticky is a else a
        served_by_other = rows_served(other)
        # When the episode's server dies, its next call goes to the other one
        sticky.kill()
        again = await engine.generate([PROMPT], GREEDY, session="episode-1")
        assert again[0].tokens.tolist() == first[0].tokens.tolist()  # same weights, greedy
        assert rows_served(other) == served_by_other + 1
        assert [s.healthy for s in engine.servers if s.url == sticky.url] == [False]
        # When every server is dead, the call fails with the retryable error
        other.kill()
        with pytest.raises(ServerUnavailable):
            await engine.generate([PROMPT], GREEDY)
        # When a server comes back on the same port, the health check takes it back in
        revived = start_serve_model(tmp_path, port=sticky.port)
        try:
            await trio.to_thread.run_sync(wait_healthy, revived)
            await engine.check_all()
            assert (await engine.generate([PROMPT], GREEDY))[0].tokens.tolist() == \
                first[0].tokens.tolist()
        finally:
            revived.kill()
