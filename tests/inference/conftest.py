"""Real ``streamrl serve-model`` processes and a real vLLM server on loopback ports, with the
tiny random model."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from streamrl.models import resolve_model
from streamrl.net import free_port
from streamrl.testing.serve_model import ServeModel, start_serve_model, wait_healthy
from streamrl.testing.vllm_server import VLLMServer, start_vllm, wait_vllm_healthy

__all__ = ["ServeModel", "free_port", "start_serve_model", "wait_healthy"]


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    return resolve_model("tiny")


@pytest.fixture
def serve_models(tmp_path: Path, tiny_dir: Path) -> Iterator[Callable[[int], list[ServeModel]]]:
    """``serve_models(n)``: n healthy servers (started in parallel), killed after the test."""
    started: list[ServeModel] = []

    def start(n: int) -> list[ServeModel]:
        servers = [start_serve_model(tmp_path) for _ in range(n)]
        started.extend(servers)
        for s in servers:
            wait_healthy(s)
        return servers

    yield start
    for s in started:
        s.kill()


@pytest.fixture(scope="module")
def one_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeModel]:
    resolve_model("tiny")
    server = start_serve_model(tmp_path_factory.mktemp("serve"))
    try:
        wait_healthy(server)
        yield server
    finally:
        server.kill()


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=60) as client:
        yield client


async def assert_serves(client: httpx.AsyncClient, url: str, model: Any, prompt: list[int],
                        version: str | None = None) -> None:  # fmt: skip
    """The server's greedy tokens and their logprobs are ``model``'s (and its answer is
    stamped ``version`` when given)."""
    answer = (await client.post(url + "/generate", json={
        "input_ids": prompt, "return_logprob": True,
        "sampling_params": {"max_new_tokens": 5, "temperature": 0},
    })).json()  # fmt: skip
    if version is not None:
        assert answer["meta_info"]["weight_version"] == version
    ids = torch.tensor([prompt + answer["output_ids"]])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    assert answer["output_ids"] == logits.argmax(-1).tolist()
    ref = torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt) :, None])[:, 0]
    got = torch.tensor([t[0] for t in answer["meta_info"]["output_token_logprobs"]])
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


def require_vllm() -> None:
    """Skip where the vLLM environment is not built (``make vllm``); in CI (``$CI`` set:
    ``make test`` builds it) that is a failure, never a skip."""
    from streamrl.inference.vllm_server import VLLMNotInstalled, vllm_executable

    try:
        vllm_executable()
    except VLLMNotInstalled as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """One real vLLM server (CPU build, eager, fp32) on the tiny model for the session."""
    require_vllm()
    server = start_vllm(tmp_path_factory.mktemp("vllm"), resolve_model("tiny"))
    try:
        wait_vllm_healthy(server)
        yield server
    finally:
        server.kill()
