"""Interruptible rollouts against a real ``serve-model`` process: a weight update lands in the
middle of a long generation, and every token says which weights produced it.

Each test checks the logprobs on both sides of the switch against a teacher-forced forward
pass of the old and of the new weights in this process."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import trio

from streamrl.inference.engine import Completion
from streamrl.inference.sglang_client import open_sglang_engine
from streamrl.models import load_model
from streamrl.protocol.messages import Sampling
from tests.inference.conftest import ServeModel
from tests.inference.test_transformers_engine import assert_interrupted, perturbed

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356]
LONG = 700  # tokens: seconds on the tiny model, so an update lands mid-way


def rows_served(server: ServeModel) -> int:
    return int(httpx.get(server.url + "/server_info").json()["internal_states"][0]["rows"])


async def test_serve_model_applies_an_update_between_decoding_steps(
    serve_models: Callable[[int], list[ServeModel]], tiny_dir: Path, tmp_path: Path
) -> None:
    [server] = serve_models(1)
    old, new = load_model(tiny_dir).eval(), perturbed(tiny_dir, tmp_path / "v7")
    answer: dict[str, dict] = {}
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:

        async def long_request() -> None:
            response = await client.post("/generate", json={
                "input_ids": PROMPT, "return_logprob": True, "logprob_start_len": -1,
                "sampling_params": {"max_new_tokens": LONG, "temperature": 1.0,
                                    "sampling_seed": 3}})
            answer.update(response.json())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(long_request)
            await trio.sleep(0.5)
            # When new weights are loaded while the request runs
            update = await client.post("/update_weights_from_disk", json={
                "model_path": str(tmp_path / "v7"), "weight_version": "7"})
            # Then the update is done before the request is
            assert update.json()["success"] is True
            assert not answer, "the update must not wait for the running request"
    meta = answer["meta_info"]
    n = len(answer["output_ids"])
    # And the answer says which tokens came from which weights, in order
    [first, second] = meta["weight_versions"]
    k = first["end"]
    assert (first["version"], first["start"], second["version"], second["end"]) == \
        ("default", 0, "7", n) and second["start"] == k
    assert meta["weight_version"] == "7"
    assert meta["finish_reason"]["type"] == "length" or n > k  # EOS can only come after k
    logprobs = [p[0] for p in meta["output_token_logprobs"]]
    assert assert_interrupted(old, new, PROMPT, answer["output_ids"], logprobs,
                              [0] * k + [7] * (n - k), 0, 7, 1.0) == k


@pytest.mark.parametrize("interrupt", ["resubmit", "in_place"])
async def test_client_update_interrupts_a_long_generation(
    serve_models: Callable[[int], list[ServeModel]], tiny_dir: Path, tmp_path: Path,
    interrupt: str,
) -> None:
    [server] = serve_models(1)
    old, new = load_model(tiny_dir).eval(), perturbed(tiny_dir, tmp_path / "v7")
    out: list[Completion] = []
    async with open_sglang_engine([server.url], health_interval_s=60,
                                  interrupt=interrupt) as engine:

        async def long_generation() -> None:
            out.extend(await engine.generate(
                [PROMPT], Sampling(max_new_tokens=LONG, temperature=1.0, seed=3),
                session="episode"))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(long_generation)
            await trio.sleep(0.5)
            # When the generator publishes new weights while the request runs
            await engine.update_weights(tmp_path / "v7", 7)
            assert not out, "the update must not wait for the running request"
        resubmits = engine.resubmits
    # Then the completion has tokens of both versions, in order, each with its own logprob
    [c] = out
    assert c.weight_version == 0 and c.finish_reason in ("length", "stop")
    if c.finish_reason == "length":
        assert len(c.tokens) == LONG
    k = assert_interrupted(old, new, PROMPT, c.tokens.tolist(), c.logprobs.tolist(),
                           c.token_versions().tolist(), 0, 7, 1.0)
    assert 0 < k < len(c.tokens)
    if interrupt == "resubmit":
        # aborted, then resubmitted with the tokens so far: the server decoded two rows
        assert resubmits == 1 and rows_served(server) == 2
    else:
        assert resubmits == 0 and rows_served(server) == 1
