"""A server takes one weight update at a time from a client: a second sync of a server whose
load is under way (a health check that found it behind the new target, or a second update)
waits for that load, then loads only what is still missing. A real SGLang server died of two
overlapping ``update_weights_from_disk`` (docs/inference.md, "SGLang on this machine").
Against a real ``serve-model`` process through the SGLang client."""

from __future__ import annotations

from typing import Any

import trio

from streamrl.inference.http_engine import Server
from streamrl.inference.sglang_client import open_sglang_engine
from streamrl.models import resolve_model


async def test_a_second_sync_waits_for_the_load_under_way(one_server: Any) -> None:
    tiny = resolve_model("tiny")
    async with open_sglang_engine([one_server.url], health_interval_s=3600) as engine:
        loading, peak, loads = 0, 0, []
        started = trio.Event()
        original = engine._load

        async def counted(server: Server, path: str, version: int) -> None:
            nonlocal loading, peak
            loading += 1
            peak = max(peak, loading)
            started.set()
            try:
                await original(server, path, version)
                loads.append(version)
            finally:
                loading -= 1

        engine._load = counted  # type: ignore[method-assign]
        async with trio.open_nursery() as nursery:
            # Given a server loading version 1
            nursery.start_soon(engine.update_weights, tiny, 1)
            await started.wait()
            # When version 2 is loaded on it meanwhile
            nursery.start_soon(engine.update_weights, tiny, 2)
        # Then the loads did not overlap, each version was loaded once, in order
        assert peak == 1 and loads == [1, 2]
        [server] = engine.servers
        assert server.healthy and server.weight_version == 2
