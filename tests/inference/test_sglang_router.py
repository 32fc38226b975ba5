"""The real ``sglang-router`` (PyPI, a Rust binary, no torch) in front of two ``serve-model``
processes on loopback: it registers them (their /server_info and /get_model_info), balances
/generate over them, and the client's weight updates and interrupted requests go through.

The router is not a project dependency: the test runs where ``sglang_router`` is importable
in this interpreter, or in the one ``STREAMRL_SGLANG_ROUTER_PYTHON`` names (e.g. a separate
venv: ``python -m venv /tmp/r && /tmp/r/bin/pip install sglang-router``), and skips
otherwise."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import trio

from streamrl.inference.sglang_client import open_sglang_engine
from streamrl.protocol.messages import Sampling
from tests.inference.conftest import ServeModel, free_port
from tests.inference.test_interruptible import LONG, PROMPT, rows_served
from tests.inference.test_weight_sync import publish_perturbed


def router_python() -> str | None:
    configured = os.environ.get("STREAMRL_SGLANG_ROUTER_PYTHON")
    if configured:
        return configured if Path(configured).exists() else None
    return sys.executable if importlib.util.find_spec("sglang_router") else None


PYTHON = router_python()
# .ci/run installs it: in CI a missing router fails the test (router fixture), never skips
pytestmark = pytest.mark.skipif(
    PYTHON is None and not os.environ.get("CI"),
    reason="sglang-router is not installed (pip install sglang-router, here or in a venv "
    "named by STREAMRL_SGLANG_ROUTER_PYTHON=<its python>)",
)


@pytest.fixture
def router(serve_models: Callable[[int], list[ServeModel]], tmp_path: Path
           ) -> Iterator[tuple[str, list[ServeModel]]]:
    if PYTHON is None:
        pytest.fail("CI is set but sglang-router is not installed (.ci/run installs it)")
    servers = serve_models(2)
    port = free_port()
    assert PYTHON is not None
    process = subprocess.Popen(
        [PYTHON, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
         "--worker-urls", *[s.url for s in servers], "--policy", "round_robin",
         "--log-level", "warn"],
        stdout=(tmp_path / "router.log").open("wb"), stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, (tmp_path / "router.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "router not healthy after 60 s"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    workers = httpx.get(url + "/workers", timeout=2).json()["workers"]
                    if len(workers) == 2 and all(w["is_healthy"] for w in workers):
                        break
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            time.sleep(0.5)
        yield url, servers
    finally:
        process.kill()
        process.wait(10)


@pytest.mark.system
async def test_router_balances_and_carries_updates_and_interruptions(
    router: tuple[str, list[ServeModel]], tiny_dir: Path, tmp_path: Path
) -> None:
    url, servers = router
    async with open_sglang_engine([s.url for s in servers], router_url=url,
                                  health_interval_s=60) as engine:
        # Given the router in front of two servers, requests spread over both
        for _ in range(4):
            [c] = await engine.generate([PROMPT], Sampling(max_new_tokens=4, temperature=0))
            assert c.finish_reason == "length" and c.weight_version == 0
        assert [rows_served(s) for s in servers] == [2, 2]
        # When weights are published while a long generation runs through the router
        path = await trio.to_thread.run_sync(publish_perturbed, tiny_dir, tmp_path / "w", 1)
        out = []

        async def long_generation() -> None:
            out.extend(await engine.generate(
                [PROMPT], Sampling(max_new_tokens=LONG, temperature=1.0, seed=3)))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(long_generation)
            await trio.sleep(0.5)
            await engine.update_weights(path, 1)
        # Then both servers serve version 1, and the interrupted request was aborted (its
        # tokens so far kept) and resubmitted through the router: tokens of both versions
        for s in servers:
            assert httpx.get(s.url + "/model_info").json()["weight_version"] == "1"
        [c] = out
        versions = c.token_versions().tolist()
        assert set(versions) == {0, 1} and versions == sorted(versions)
        assert engine.resubmits == 1
        [after] = await engine.generate([PROMPT], Sampling(max_new_tokens=4, temperature=0))
        assert after.weight_version == 1
