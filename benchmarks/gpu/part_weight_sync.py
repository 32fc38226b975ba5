"""Part ``weight_sync`` of ``benchmarks/gpu/check.py``: the learner's new weights reaching a
``serve-model`` server, over the broadcast group and through disk, each timed and checked.

The learner is the project's :class:`learner.train.Trainer` with ``parallelism = "fsdp"``
under the process group (as in part ``learner``); after each step it takes the learner
actor's snapshot (:class:`learner.fsdp.ShardedSnapshot`: the shards gathered into one CPU
model, ``snapshot_s``). The server is :func:`inference.server.serve_model` (what
``streamrl serve-model`` runs: the transformers engine behind the SGLang HTTP subset), started
in this process on a loopback port from version 0 as the learner saved it.

- broadcast (``learner.weight_sync = "broadcast"``): the learner actor's
  :class:`inference.sglang_client.WeightBroadcaster` forms the group with the server
  (``group_init_s``) and sends :func:`actors.weight_sync.named_tensors` of the snapshot in
  buckets of ``--bucket-mb`` (``/update_weights_from_distributed``): ``broadcast_s`` runs
  from the pause to every server serving them. gloo, also on a GPU: serve-model runs on
  the CPU and joins gloo groups only (a learner on CUDA broadcasts over NCCL to SGLang
  servers, which this check does not start);
- disk (``weight_sync = "disk"``): :func:`learner.weights.save_weights` of the next
  snapshot (``save_s``, fsynced), then the generator's own reload through
  :meth:`inference.sglang_client.SGLangEngine.update_weights` (``load_s``: pause,
  ``/update_weights_from_disk``, continue).

Each path is verified: the server's greedy completion of a fixed prompt, with its
logprobs, must be the snapshot's own (``max_logprob_diff`` against a teacher-forced forward
under the snapshot's weights, tolerance 1e-3), stamped with the new version, and must differ
from what it served before the update (``changed``).
"""

from __future__ import annotations

import argparse
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import torch
import trio
from common import Report, build_model, open_process_group, save_version, sync, synthetic_batch

PROMPT = [1, 17, 42, 99, 7, 3, 250, 11]
NEW_TOKENS = 4
TOLERANCE = 1e-3


async def served(http: httpx.AsyncClient, url: str) -> dict[str, Any]:
    """The server's greedy completion of :data:`PROMPT`: tokens, logprobs, version label."""
    response = await http.post(url + "/generate", json={
        "input_ids": PROMPT, "return_logprob": True,
        "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0},
    })  # fmt: skip
    response.raise_for_status()
    answer = response.json()
    return {"tokens": answer["output_ids"], "version": answer["meta_info"]["weight_version"],
            "logprobs": [t[0] for t in answer["meta_info"]["output_token_logprobs"]]}


def check(reference: Any, snapshot: Any, answer: dict[str, Any], before: dict[str, Any],
          version: str) -> dict[str, Any]:  # fmt: skip
    """Does ``answer`` come from the snapshot's weights (greedy tokens and their logprobs,
    stamped ``version``), and does it differ from ``before``? ``reference``: a CPU model
    loaded from version 0, the snapshot's weights copied into it (the snapshot's own model is
    built for saving only: its rotary buffers are not initialised)."""
    reference.load_state_dict(snapshot.state_dict())
    ids = torch.tensor([PROMPT + answer["tokens"]])
    with torch.inference_mode():
        logits = reference(input_ids=ids).logits[0, len(PROMPT) - 1 : -1].float()
    local = torch.log_softmax(logits, -1).gather(1, ids[0, len(PROMPT) :, None])[:, 0]
    diff = float((local - torch.tensor(answer["logprobs"])).abs().max())
    greedy = logits.argmax(-1).tolist() == answer["tokens"]
    moved = answer["tokens"] != before["tokens"] or max(
        abs(a - b) for a, b in zip(answer["logprobs"], before["logprobs"], strict=True)
    ) > 1e-4
    ok = greedy and diff <= TOLERANCE and answer["version"] == version
    return {"verified": ok, "max_logprob_diff": diff,
            "changed": moved, "served_version": answer["version"]}  # fmt: skip


@dataclass
class Learner:
    """The learner's side: its trainer, the actor's snapshot, a batch to step on, and the
    CPU model the checks copy the snapshot into (see :func:`check`)."""

    trainer: Any
    snapshot: Any
    batch: Any
    device: str
    world: int
    reference: Any
    root: Path

    def step(self) -> float:
        """One step, then the actor's snapshot of it; returns the snapshot's seconds."""
        self.trainer.step_batch(self.batch, groups=1)
        sync(self.device)
        started = time.perf_counter()
        self.snapshot.take(self.trainer.model, None, self.trainer.steps, None)
        return time.perf_counter() - started


async def via_broadcast(learner: Learner, http: httpx.AsyncClient, url: str,
                        args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    """Version 1 over the weight-update group (the learner actor's ``ServerSync.push``)."""
    from streamrl.actors.weight_sync import named_tensors
    from streamrl.inference.sglang_client import WeightBroadcaster, buckets
    from streamrl.net import free_port

    before = await served(http, url)
    snapshot_s = await trio.to_thread.run_sync(learner.step)
    tensors = named_tensors(learner.snapshot.model)
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    broadcaster = WeightBroadcaster(http, [url], master_port=free_port(), backend="gloo",
                                    bucket_bytes=args.bucket_mb << 20, timeout_s=120)
    started = time.perf_counter()
    await broadcaster.init()
    group_s = time.perf_counter() - started
    started = time.perf_counter()
    await broadcaster.broadcast(tensors, 1)
    broadcast_s = time.perf_counter() - started
    return {
        "snapshot_s": round(snapshot_s, 3), "group_init_s": round(group_s, 3),
        "broadcast_s": round(broadcast_s, 3), "bytes": size, "tensors": len(tensors),
        "buckets": len(buckets(tensors, args.bucket_mb << 20)),
        "gb_per_s": round(size / broadcast_s / 1e9, 3),
        **check(learner.reference, learner.snapshot.model, await served(http, url), before, "1"),
    }  # fmt: skip


async def via_disk(learner: Learner, http: httpx.AsyncClient, url: str) -> dict[str, Any]:
    """Version 2 saved, then reloaded by the generator's client (``weight_sync = "disk"``)."""
    from streamrl.inference.sglang_client import open_sglang_engine

    await http.post(url + "/continue_generation")  # a failed broadcast leaves it paused
    before = await served(http, url)
    snapshot_s = await trio.to_thread.run_sync(learner.step)
    started = time.perf_counter()
    path = await trio.to_thread.run_sync(save_version, learner.snapshot.model, learner.root, 2)
    save_s = time.perf_counter() - started
    async with open_sglang_engine([url]) as engine:
        started = time.perf_counter()
        await engine.update_weights(path, 2)
        load_s = time.perf_counter() - started
    return {
        "snapshot_s": round(snapshot_s, 3), "save_s": round(save_s, 3),
        "load_s": round(load_s, 3), "total_s": round(save_s + load_s, 3),
        **check(learner.reference, learner.snapshot.model, await served(http, url), before, "2"),
    }  # fmt: skip


async def fail_soft(measure: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
    """One path's figures, or its error (the other path still runs)."""
    try:
        return await measure()
    except Exception as exc:  # a path's failure is one of its figures
        traceback.print_exc()
        return {"error": f"{type(exc).__name__}: {exc}"[:2000]}


def open_learner(args: argparse.Namespace, work: Path) -> Learner:
    """The FSDP trainer, its snapshot, and version 0 saved for the server to start from."""
    from streamrl.learner import fsdp
    from streamrl.learner.train import TrainConfig, Trainer
    from streamrl.models import load_model

    device = "cpu" if args.cpu else "cuda"
    world = open_process_group(device)
    trainer = Trainer(build_model(args.tiny, device), TrainConfig(
        lr=1e-3, device=device, bf16=True, parallelism="fsdp", micro_batch_size=4))
    snapshot = fsdp.ShardedSnapshot(work)
    snapshot.take(trainer.model, None, 0, None)
    v0 = save_version(snapshot.model, work / "weights", 0)
    batch = synthetic_batch(4, 8, 24, trainer.model.config.vocab_size)
    return Learner(trainer, snapshot, batch, device, world, load_model(v0).eval(), v0.parent)


async def sync_both(args: argparse.Namespace, report: Report, work: Path) -> None:
    from streamrl.inference.server import serve_model
    from streamrl.net import free_port

    learner = open_learner(args, work)
    report.update(learner=f"Trainer fsdp, {learner.world} rank(s), {learner.device}",
                  backend="gloo", bucket_mb=args.bucket_mb)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(timeout=300) as http, trio.open_nursery() as nursery:
        started = time.perf_counter()
        await nursery.start(partial(serve_model, learner.root / "v000000", host="127.0.0.1",
                                    port=port, threads=0, weight_version="0"))
        report.update(server_start_s=round(time.perf_counter() - started, 2))
        report.update(broadcast=await fail_soft(partial(via_broadcast, learner, http, url, args)))
        report.update(disk=await fail_soft(partial(via_disk, learner, http, url)))
        nursery.cancel_scope.cancel()


def run(args: argparse.Namespace, report: Report) -> None:
    with tempfile.TemporaryDirectory(prefix="gpu-check-sync-") as work:
        trio.run(sync_both, args, report, Path(work))
