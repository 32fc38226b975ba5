"""Weight sync from disk through SGLangEngine: pause -> update_weights_from_disk -> continue
on real ``serve-model`` processes, and a replica that joins mid-run loads the current
version before it takes work."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import torch
import trio

from streamrl.inference.sglang_client import open_sglang_engine
from streamrl.learner.weights import save_weights
from streamrl.models import load_model
from streamrl.protocol.messages import Sampling
from tests.inference.conftest import ServeModel, free_port, start_serve_model, wait_healthy

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356]
GREEDY = Sampling(max_new_tokens=6, temperature=0.0)


def publish_perturbed(tiny_dir: Path, root: Path, version: int) -> Path:
    """What the learner does: new weights written as a versioned HF directory."""
    model = load_model(tiny_dir)
    torch.manual_seed(version)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    return save_weights(model, tiny_dir, root, version, keep_last=3)


async def test_weight_sync_from_disk_and_a_joining_replica(
    serve_models: Callable[[int], list[ServeModel]], tiny_dir: Path, tmp_path: Path,
) -> None:
    (a,) = serve_models(1)
    late_port = free_port()
    late_url = f"http://127.0.0.1:{late_port}"
    async with open_sglang_engine([a.url, late_url], health_interval_s=60) as engine:
        assert [s.healthy for s in engine.servers] == [True, False]
        before = (await engine.generate([PROMPT], GREEDY))[0]
        # When the learner publishes version 1 and the generator syncs its servers
        path = await trio.to_thread.run_sync(publish_perturbed, tiny_dir, tmp_path / "w", 1)
        await engine.update_weights(path, 1)
        # Then the server reports it and samples under it, with other outputs
        assert engine.weight_version == 1
        info = httpx.get(a.url + "/get_model_info").json()
        assert info["weight_version"] == "1" and info["model_path"] == str(path)
        after = (await engine.generate([PROMPT], GREEDY))[0]
        assert after.weight_version == 1
        assert after.tokens.tolist() != before.tokens.tolist()
        # When a replica joins mid-run (it starts with the initial weights)
        late = start_serve_model(tmp_path, port=late_port)
        try:
            await trio.to_thread.run_sync(wait_healthy, late)
            assert httpx.get(late_url + "/model_info").json()["weight_version"] == "default"
            await engine.check_all()
            # Then it loaded version 1 before being taken into rotation
            assert [s.healthy for s in engine.servers] == [True, True]
            assert httpx.get(late_url + "/model_info").json()["weight_version"] == "1"
            a.kill()
            joined = (await engine.generate([PROMPT], GREEDY))[0]
            assert joined.weight_version == 1
            assert joined.tokens.tolist() == after.tokens.tolist()
        finally:
            late.kill()
