"""The distributed weight-update path over gloo: the learner (rank 0) broadcasts every tensor
to two real ``serve-model`` processes, which then sample under exactly those weights."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import torch

from streamrl.inference.sglang_client import WeightBroadcaster
from streamrl.models import load_model
from tests.inference.conftest import ServeModel, assert_serves, free_port

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356]


async def test_broadcast_updates_every_server(
    serve_models: Callable[[int], list[ServeModel]], tiny_dir: Path,
) -> None:
    servers = serve_models(2)
    model = load_model(tiny_dir).eval()
    torch.manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    tensors = {n: t for n, t in model.state_dict().items() if n != "lm_head.weight"}
    async with httpx.AsyncClient(timeout=120) as client:
        # When the learner forms the group with both servers and broadcasts version 3
        broadcaster = WeightBroadcaster(client, [s.url for s in servers],
                                        master_port=free_port())
        await broadcaster.init()
        await broadcaster.broadcast(tensors, version=3)
        for s in servers:
            # Then each reports version 3 and its logprobs are those of the learner's model
            assert (await client.get(s.url + "/model_info")).json()["weight_version"] == "3"
            await assert_serves(client, s.url, model, PROMPT, version="3")
        # And a server refuses NCCL (it runs on the CPU)
        refused = await client.post(servers[0].url + "/init_weights_update_group", json={
            "master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
            "world_size": 2, "group_name": "g", "backend": "nccl"})
        assert refused.status_code == 400 and refused.json()["success"] is False
