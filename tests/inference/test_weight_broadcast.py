"""The distributed weight-update path over gloo: the learner (rank 0) broadcasts every tensor
to two real ``serve-model`` processes, which then sample under exactly those weights."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import torch

from streamrl.inference.sglang_client import WeightBroadcaster
from streamrl.learner.model import load_model
from tests.inference.conftest import ServeModel, free_port

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
            answer = (await client.post(s.url + "/generate", json={
                "input_ids": PROMPT, "return_logprob": True,
                "sampling_params": {"max_new_tokens": 5, "temperature": 0},
            })).json()
            assert answer["meta_info"]["weight_version"] == "3"
            ids = torch.tensor([PROMPT + answer["output_ids"]])
            with torch.inference_mode():
                logits = model(input_ids=ids).logits[0, len(PROMPT) - 1 : -1]
            assert answer["output_ids"] == logits.argmax(-1).tolist()
            ref = torch.log_softmax(logits, -1).gather(1, ids[0, len(PROMPT):, None])[:, 0]
            got = torch.tensor([t[0] for t in answer["meta_info"]["output_token_logprobs"]])
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
        # And a server refuses NCCL (it runs on the CPU)
        refused = await client.post(servers[0].url + "/init_weights_update_group", json={
            "master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
            "world_size": 2, "group_name": "g", "backend": "nccl"})
        assert refused.status_code == 400 and refused.json()["success"] is False
