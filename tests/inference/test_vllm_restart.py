"""A vLLM server that dies and comes back (two server starts of its own: a file of its own,
so that in the serial part of `make test` it runs beside the contract suite, not after it)."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
import trio

from streamrl.inference.engine import model_stop_token_ids
from streamrl.inference.http_engine import ServerUnavailable
from streamrl.inference.vllm_client import open_vllm_engine
from streamrl.models import load_tokenizer, resolve_model
from streamrl.net import free_port
from streamrl.protocol.messages import Sampling
from streamrl.testing.vllm_server import start_vllm, wait_vllm_healthy
from tests.inference.conftest import require_vllm
from tests.inference.test_engine_contract import PROMPTS, assert_logprobs
from tests.inference.test_transformers_engine import perturbed

pytestmark = pytest.mark.serial  # with the other vLLM tests (test_engine_contract.py)


async def test_vllm_server_that_comes_back_loads_the_current_weights(tmp_path: Path) -> None:
    """A vLLM server that dies is taken out of rotation (the request goes to a healthy one or
    is retried later); when it is back it loads the current weights before it takes work."""
    require_vllm()
    tiny = resolve_model("tiny")
    new = perturbed(tiny, tmp_path / "new")
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny / f, tmp_path / "new" / f)
    port = free_port()
    server = start_vllm(tmp_path, tiny, port=port)
    tokenizer = load_tokenizer(tiny)
    try:
        await trio.to_thread.run_sync(wait_vllm_healthy, server)
        async with open_vllm_engine([server.url], tokenizer=tokenizer, health_interval_s=0.5,
                                    stop_token_ids=model_stop_token_ids(tiny, tokenizer)
                                    ) as engine:
            await engine.update_weights(tmp_path / "new", 5)
            # When the server dies
            server.kill()
            with trio.fail_after(30):
                while engine.servers[0].healthy:
                    await trio.sleep(0.1)
            # Then a request finds no server (retried later by the caller, not failed)
            with pytest.raises(ServerUnavailable):
                await engine.generate([PROMPTS[0]], Sampling(max_new_tokens=2))
            # When it comes back (its initial weights)
            server = start_vllm(tmp_path, tiny, port=port)
            await trio.to_thread.run_sync(wait_vllm_healthy, server)
            with trio.fail_after(60):
                while not engine.servers[0].healthy:
                    await trio.sleep(0.1)
            # Then it serves version 5's weights before it takes work
            info = httpx.get(server.url + "/weight_info", timeout=10).json()
            assert info["weight_version"] == "5"
            prompts = [PROMPTS[0], PROMPTS[2]]
            completions = await engine.generate(prompts, Sampling(max_new_tokens=8,
                                                                  temperature=0.0))
            assert all(c.weight_version == 5 for c in completions)
            assert_logprobs(new, prompts, completions, 0.0)
    finally:
        server.kill()
