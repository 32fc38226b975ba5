"""``streamrl serve-model`` answers in the shapes of SGLang 0.5.23 (shared/reference/sglang.md).

One real server process (tiny random Llama) on a loopback port for the whole module.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
import trio

from streamrl.models import load_model
from streamrl.testing.logprobs import teacher_forced_logprobs
from streamrl.testing.wait import wait_until
from tests.inference.conftest import ServeModel

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356]
META_KEYS = {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
             "weight_version", "e2e_latency"}


def post(server: ServeModel, path: str, body: dict | None = None) -> httpx.Response:
    return httpx.post(server.url + path, json=body or {}, timeout=30)


def test_generate_input_ids_with_logprobs(one_server: ServeModel, tiny_dir: Path) -> None:
    # When a prompt is sent as input_ids with return_logprob
    r = post(one_server, "/generate", {
        "input_ids": PROMPT, "return_logprob": True, "logprob_start_len": -1,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0.8, "top_p": 1.0,
                            "sampling_seed": 5},
    })
    # Then the answer has SGLang's shape
    assert r.status_code == 200
    answer = r.json()
    assert set(answer) == {"text", "output_ids", "meta_info"}
    meta = answer["meta_info"]
    assert META_KEYS | {"output_token_logprobs", "input_token_logprobs"} == set(meta)
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == len(PROMPT) and meta["completion_tokens"] == 6
    assert meta["weight_version"] == "default" and meta["cached_tokens"] == 0
    triples = meta["output_token_logprobs"]
    assert [t[1] for t in triples] == answer["output_ids"] and all(t[2] is None for t in triples)
    # And the logprobs are the model's, at the request's temperature
    model = load_model(tiny_dir).eval()
    ref = teacher_forced_logprobs(model, PROMPT, answer["output_ids"], 0.8)
    torch.testing.assert_close(torch.tensor([t[0] for t in triples]), ref, atol=1e-4, rtol=0)


def test_generate_batch_and_text(one_server: ServeModel) -> None:
    r = post(one_server, "/generate", {
        "input_ids": [PROMPT, PROMPT[:3]], "sampling_params": {"max_new_tokens": 3},
    })
    answers = r.json()
    assert isinstance(answers, list) and len(answers) == 2
    assert [a["meta_info"]["prompt_tokens"] for a in answers] == [len(PROMPT), 3]
    assert "output_token_logprobs" not in answers[0]["meta_info"]
    r = post(one_server, "/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 2


def test_greedy_is_deterministic_and_stop_token_ids_cut(one_server: ServeModel) -> None:
    sampling = {"max_new_tokens": 8, "temperature": 0}
    full = post(one_server, "/generate", {"input_ids": PROMPT, "sampling_params": sampling,
                                          "return_logprob": True}).json()
    again = post(one_server, "/generate", {"input_ids": PROMPT, "sampling_params": sampling})
    assert again.json()["output_ids"] == full["output_ids"]
    stop_at = full["output_ids"][2]
    cut = post(one_server, "/generate", {
        "input_ids": PROMPT, "return_logprob": True,
        "sampling_params": {**sampling, "stop_token_ids": [stop_at]},
    }).json()
    first = full["output_ids"].index(stop_at)
    assert cut["output_ids"] == full["output_ids"][: first + 1]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}
    assert len(cut["meta_info"]["output_token_logprobs"]) == first + 1


def test_bad_requests_are_400(one_server: ServeModel) -> None:
    assert post(one_server, "/generate", {"sampling_params": {}}).status_code == 400
    assert post(one_server, "/generate", {"input_ids": PROMPT, "stream": True}).status_code == 400
    assert post(one_server, "/generate", {"input_ids": [10**9]}).status_code == 400
    r = post(one_server, "/update_weights_from_disk", {"model_path": "/nonexistent"})
    assert r.status_code == 400
    assert r.json()["success"] is False and set(r.json()) == {"success", "message",
                                                              "num_paused_requests"}


@pytest.mark.parametrize("new, old", [("/model_info", "/get_model_info"),
                                      ("/server_info", "/get_server_info")])
def test_renamed_endpoints_answer_both_spellings(one_server: ServeModel, new: str,
                                                 old: str) -> None:
    a = httpx.get(one_server.url + new).json()
    b = httpx.get(one_server.url + old).json()
    assert a.keys() == b.keys() and a["model_path"] == b["model_path"]
    assert a["weight_version"] == "default"
    if new == "/model_info":
        assert {"model_path", "tokenizer_path", "is_generation", "weight_version"} <= a.keys()
    else:
        assert a["version"] == "0.5.23" and a["port"] == one_server.port


def test_health_loads_flush(one_server: ServeModel) -> None:
    assert httpx.get(one_server.url + "/health").status_code == 200
    assert httpx.get(one_server.url + "/health_generate", timeout=30).status_code == 200
    loads = httpx.get(one_server.url + "/v1/loads").json()
    assert loads["loads"][0]["num_running_reqs"] == 0
    assert {"total_running_reqs", "total_waiting_reqs"} <= loads["aggregate"].keys()
    assert post(one_server, "/flush_cache").status_code == 200


async def test_pause_holds_requests_and_abort_by_rid(one_server: ServeModel) -> None:
    async with httpx.AsyncClient(base_url=one_server.url, timeout=30) as client:
        paused = await client.post("/pause_generation", json={"mode": "in_place"})
        assert paused.json() == {"message": "Generation paused successfully.", "status": "ok"}
        answers: dict[str, httpx.Response] = {}

        async def gen(rid: str) -> None:
            answers[rid] = await client.post("/generate", json={
                "input_ids": PROMPT, "rid": rid, "sampling_params": {"max_new_tokens": 2}})

        async with trio.open_nursery() as nursery:
            nursery.start_soon(gen, "kept")
            nursery.start_soon(gen, "dropped")
            await trio.sleep(1.0)
            # While paused nothing is answered; both wait
            assert answers == {}
            loads = (await client.get("/v1/loads")).json()
            assert loads["aggregate"]["total_waiting_reqs"] == 2
            assert (await client.post("/flush_cache")).status_code == 400  # requests in flight
            assert (await client.post("/abort_request", json={"rid": "dropped"})).status_code \
                == 200
            await trio.sleep(0.5)
            assert answers["dropped"].json()["meta_info"]["finish_reason"]["type"] == "abort"
            assert "kept" not in answers
            cont = await client.post("/continue_generation", json={})
            assert cont.json()["message"] == "Generation continued successfully."
        assert answers["kept"].json()["meta_info"]["finish_reason"]["type"] == "length"


async def test_client_disconnect_drops_the_request(one_server: ServeModel) -> None:
    async with httpx.AsyncClient(base_url=one_server.url, timeout=30) as client:
        await client.post("/pause_generation", json={"mode": "in_place"})
        try:
            with trio.move_on_after(0.5):  # the client gives up: the connection closes
                await client.post("/generate", json={"input_ids": PROMPT})

            async def none_waiting() -> bool:
                loads = (await client.get("/v1/loads")).json()
                return not loads["aggregate"]["total_waiting_reqs"]

            await wait_until(none_waiting, timeout=5)
        finally:
            await client.post("/continue_generation", json={})
