"""Weight sync from disk: seconds from the learner's publish to every server serving it.

    .venv/bin/python benchmarks/weight_sync.py --json [--replicas 1,3] [--models tiny,smollm2-135m]

For each model and replica count it starts that many real ``streamrl serve-model`` processes
(one torch thread each), an embedded Redis, and the generator's own weight follower
(:func:`actors.generator.serve_weight_updates` over :class:`inference.sglang_client.SGLangEngine`).
Then, ``--versions`` times, it plays the learner: writes a perturbed copy of the weights as
a versioned HF directory (``learner.weights.save_weights``, timed apart as ``save_s``) and
publishes the ``WeightsPublished`` event. ``publish_to_serving_s`` runs from that event to
the moment every server answers a one-token ``/generate`` stamped with the new version
(probed every 10 ms, so it includes up to 10 ms of probing slack): the Redis event hop,
pause -> update_weights_from_disk -> continue on each server, and the reload itself.
Baseline in the same run: ``inprocess_load_s``, the in-process engine loading the same
directory (no HTTP, no event), the floor for the reload alone.

The distributed path, ``broadcast_to_serving_s``: the learner is rank 0 of a gloo
weight-update group with the servers (:class:`inference.sglang_client.WeightBroadcaster`) and
sends every tensor; timed from the start of the broadcast to every server answering under it.

Simplifications: everything on one machine (the directory is on a local disk; across machines
it would be a shared file system); gloo over loopback stands in for NCCL.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from streamrl.actors.generator import serve_weight_updates
from streamrl.config.schema import load_config
from streamrl.inference.sglang_client import WeightBroadcaster, open_sglang_engine
from streamrl.inference.transformers_engine import open_transformers_engine
from streamrl.learner.weights import save_weights
from streamrl.models import load_model, resolve_model
from streamrl.net import free_port
from streamrl.protocol import names as N
from streamrl.protocol.messages import WeightsPublished, new_id, now
from streamrl.protocol.names import Names
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import encode
from streamrl.queues.server import ServerProcess
from streamrl.queues.streams import FIELD
from streamrl.runtime.context import ActorContext
from streamrl.runtime.logs import configure_logging
from streamrl.testing.serve_model import start_serve_model, wait_healthy


async def serving(url: str, version: int, client: httpx.AsyncClient) -> None:
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}
    while True:
        r = await client.post(url + "/generate", json=body)
        if r.status_code == 200 and r.json()["meta_info"]["weight_version"] == str(version):
            return
        await trio.sleep(0.01)


async def measure_broadcast(servers: list[Any], model: Any, versions: int) -> list[float]:
    """The distributed path: the learner (rank 0 of a gloo group) broadcasts every tensor."""
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    tensors = {n: t for n, t in model.state_dict().items() if n not in tied}
    out = []
    async with httpx.AsyncClient(timeout=300) as client:
        broadcaster = WeightBroadcaster(client, [s.url for s in servers],
                                        master_port=free_port())
        await broadcaster.init()
        for version in range(versions + 1, 2 * versions + 1):
            t0 = time.perf_counter()
            await broadcaster.broadcast(tensors, version)
            async with trio.open_nursery() as waiters:
                for s in servers:
                    waiters.start_soon(serving, s.url, version, client)
            out.append(time.perf_counter() - t0)
    return out


async def measure(model: str, replicas: int, versions: int, work: Path, redis_url: str
                  ) -> dict[str, Any]:
    model_dir = resolve_model(model)
    servers = [start_serve_model(work, model=model) for _ in range(replicas)]
    try:
        for s in servers:
            await trio.to_thread.run_sync(wait_healthy, s, 300.0)
        names = Names(run=f"ws{replicas}{model[:4]}{os.getpid()}")
        config = load_config(None, [
            f'run.name="{names.run}"', f'run.redis_url="{redis_url}"', "queues.block_ms=1000",
            'generator.engine="sglang"', "generator.health_interval_s=30",
            "generator.server_urls=[" + ",".join(f'"{s.url}"' for s in servers) + "]",
        ])
        redis = RedisClient(redis_url)
        learner_model = await trio.to_thread.run_sync(load_model, model_dir)
        save_s, sync_s, inprocess_s = [], [], []
        root = work / f"weights-{model}-{replicas}"
        async with (
            open_sglang_engine(config.generator.server_urls, health_interval_s=30) as engine,
            httpx.AsyncClient(timeout=120) as probe,
            trio.open_nursery() as nursery,
        ):
            ctx = ActorContext(config, redis, names)
            await nursery.start(serve_weight_updates, ctx, engine)
            for version in range(1, versions + 1):
                def write(v: int = version) -> Path:
                    with torch.no_grad():
                        for p in learner_model.parameters():
                            p.mul_(1.0 + 1e-3 * torch.randn_like(p))
                    return save_weights(learner_model, model_dir, root, v, keep_last=2)

                t = time.perf_counter()
                path = await trio.to_thread.run_sync(write)
                save_s.append(time.perf_counter() - t)
                event = WeightsPublished(id=new_id(), created_at=now(), policy_version=version,
                                         version=version, path=str(path))
                t0 = time.perf_counter()
                await redis.call(redis.sync.xadd, names.stream(N.WEIGHTS), {FIELD: encode(event)})
                async with trio.open_nursery() as waiters:
                    for s in servers:
                        waiters.start_soon(serving, s.url, version, probe)
                sync_s.append(time.perf_counter() - t0)
            nursery.cancel_scope.cancel()
        redis.close()
        broadcast_s = await measure_broadcast(servers, learner_model, versions)
        async with open_transformers_engine(model_dir, threads=1) as local:
            for version in range(1, versions + 1):
                t = time.perf_counter()
                await local.update_weights(root / f"v{versions:06d}", version)
                inprocess_s.append(time.perf_counter() - t)
        size = sum(f.stat().st_size for f in (root / f"v{versions:06d}").glob("*.safetensors"))
        return {
            "model": model, "replicas": replicas, "versions": versions,
            "weights_mb": round(size / 2**20, 1),
            "publish_to_serving_s_median": round(statistics.median(sync_s), 3),
            "publish_to_serving_s_max": round(max(sync_s), 3),
            "publish_to_serving_s": [round(x, 3) for x in sync_s],
            "save_s_median": round(statistics.median(save_s), 3),
            "broadcast_to_serving_s_median": round(statistics.median(broadcast_s), 3),
            "broadcast_to_serving_s_max": round(max(broadcast_s), 3),
            "inprocess_load_s_median": round(statistics.median(inprocess_s), 3),
        }
    finally:
        for s in servers:
            s.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--replicas", default="1,3")
    parser.add_argument("--models", default="tiny")
    parser.add_argument("--versions", type=int, default=5, help="weight updates per setting")
    args = parser.parse_args()
    configure_logging(actor="weight-sync", level="warning", stream=sys.stderr)  # stdout: JSON
    torch.set_num_threads(1)
    results = []
    with tempfile.TemporaryDirectory(prefix="weight-sync-") as tmp:
        work = Path(tmp)
        with ServerProcess(data_dir=work / "redis") as redis_server:
            for model in args.models.split(","):
                for replicas in (int(r) for r in args.replicas.split(",")):
                    results.append(trio.run(measure, model, replicas, args.versions, work,
                                            redis_server.url))
                    if not args.json:
                        print(results[-1], flush=True)
    report = {
        "benchmark": "weight_sync", "paths": ["disk", "distributed (gloo)"],
        "definitions": {
            "publish_to_serving_s": "WeightsPublished XADD -> every server answers /generate "
                                    "stamped with the new weight_version (10 ms probes)",
            "save_s": "learner writes the versioned safetensors directory (fsync, rename)",
            "inprocess_load_s": "baseline: in-process TransformersEngine.update_weights",
            "broadcast_to_serving_s": "distributed path: learner starts the gloo broadcast "
                                      "(pause, every tensor, continue) -> every server answers "
                                      "stamped with the new version; no disk, no event",
        },
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__},
        "results": results,
    }
    print(json.dumps(report, indent=2 if not args.json else None))


if __name__ == "__main__":
    main()
