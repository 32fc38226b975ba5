"""Interruptible rollouts: how long a weight update takes while a long generation runs.

    .venv/bin/python benchmarks/interrupt.py --json [--model tiny] [--tokens 1500]

One real ``streamrl serve-model`` process (one torch thread) and the generator's SGLang
client. A generation of ``--tokens`` tokens (sampled, no stop) starts; ``--after`` seconds
later the client runs a weight update (pause -> [abort] -> update_weights_from_disk ->
continue). Per ``interrupt`` mode it reports ``update_s`` (the update call, start to every
server serving the new version), ``generation_s`` (the long request, end to end),
``tokens_old`` / ``tokens_new`` (tokens sampled by each version) and ``resubmits``.

Baseline in the same run: ``uninterrupted_generation_s``, the same generation with no
update. An update that had to wait for the generation (what the engine did before
interruptible rollouts) would take about ``uninterrupted_generation_s - after`` plus the
reload; ``wait_free_speedup`` is that over ``update_s`` (in-place mode).

Simplifications: one server on one machine; the tiny random model by default (decode speed
is what matters, not quality).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from streamrl.inference.sglang_client import open_sglang_engine
from streamrl.models import load_model, resolve_model
from streamrl.protocol.messages import Sampling
from streamrl.runtime.logs import configure_logging
from streamrl.testing.serve_model import start_serve_model, wait_healthy

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356]


def perturbed(model_dir: Path, out: Path) -> Path:
    model = load_model(model_dir)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(out, safe_serialization=True)
    return out


async def one(url: str, interrupt: str, weights: Path | None, version: int, tokens: int,
              after: float) -> dict[str, Any]:
    async with open_sglang_engine([url], interrupt=interrupt, health_interval_s=60) as engine:
        result: dict[str, Any] = {}
        sampling = Sampling(max_new_tokens=tokens, temperature=1.0, seed=1)

        async def generate() -> None:
            t0 = time.perf_counter()
            [c] = await engine.generate([PROMPT], sampling)
            result["generation_s"] = round(time.perf_counter() - t0, 3)
            versions = c.token_versions()
            result["tokens_old"] = int((versions < version).sum()) if weights else len(versions)
            result["tokens_new"] = int((versions >= version).sum()) if weights else 0

        async with trio.open_nursery() as nursery:
            nursery.start_soon(generate)
            if weights is not None:
                await trio.sleep(after)
                t0 = time.perf_counter()
                await engine.update_weights(weights, version)
                result["update_s"] = round(time.perf_counter() - t0, 3)
        result["resubmits"] = engine.resubmits
        return result


async def measure(url: str, weights: Path, tokens: int, after: float) -> dict[str, Any]:
    base = await one(url, "in_place", None, 0, tokens, after)
    out: dict[str, Any] = {"uninterrupted_generation_s": base["generation_s"]}
    for i, mode in enumerate(("in_place", "resubmit")):
        out[mode] = await one(url, mode, weights, i + 1, tokens, after)
    reload_s = out["in_place"]["update_s"]
    waited = max(0.0, base["generation_s"] - after) + reload_s
    out["update_if_it_waited_s"] = round(waited, 3)
    out["wait_free_speedup"] = round(waited / max(reload_s, 1e-9), 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--tokens", type=int, default=1500)
    parser.add_argument("--after", type=float, default=1.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    configure_logging(actor="bench", level="warning")
    model_dir = resolve_model(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        weights = perturbed(model_dir, Path(tmp) / "v")
        server = start_serve_model(Path(tmp), model="smollm2" if args.model.startswith(
            "smollm2") else args.model)
        try:
            wait_healthy(server)
            result = trio.run(measure, server.url, weights, args.tokens, args.after)
        finally:
            server.kill()
    result.update(model=args.model, tokens=args.tokens, after_s=args.after,
                  machine=platform.machine(), torch=torch.__version__)
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
