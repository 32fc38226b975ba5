"""Weight sync in the loop: the learner sends each new version to the inference servers over
a weight-update group (``learner.weight_sync = "broadcast"``).

The learner is rank 0 of a group with every server of ``generator.server_urls`` (SGLang's
``/init_weights_update_group``; gloo on CPU, NCCL on CUDA). After a step is saved, and
before its ``weights`` event is announced, :meth:`ServerSync.push` pauses the servers, sends
the version's tensors bucket by bucket (``/update_weights_from_distributed``, at most
``learner.broadcast_bucket_mb`` per call) and lets them continue. The generators, following the
event, find every server on that version already and load nothing
(:meth:`inference.sglang_client.SGLangEngine.update_weights`).

Disk stays the fallback: every version is saved as before. If the group cannot be formed
(a server down at start), or a broadcast fails (a server gone, a timeout), the learner has
every server it can reach load that version from disk, and syncs by disk for the rest of
the run (a gloo group does not survive a lost member); a server that joins late or restarts
loads the current version from disk through its generator, as with ``weight_sync = "disk"``.
"""

from __future__ import annotations

import time

import httpx
import structlog
import torch

from streamrl.config.schema import Config
from streamrl.inference.sglang_client import BroadcastFailed, WeightBroadcaster
from streamrl.net import free_port

log = structlog.get_logger()


def named_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state as the servers load it: each tensor once (a tied ``lm_head.weight``
    shares the embedding's storage and is left out, as in a saved checkpoint)."""
    seen: set[int] = set()
    out = {}
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        out[name] = tensor
    return out


class ServerSync:
    """The learner's side of ``weight_sync = "broadcast"`` (see the module docstring)."""

    def __init__(self, config: Config, client: httpx.AsyncClient) -> None:
        learner, generator = config.learner, config.generator
        self.urls = list(generator.server_urls)
        self.broadcaster = WeightBroadcaster(
            client,
            self.urls,
            master_port=free_port(),
            master_address=learner.broadcast_master_address,
            backend="nccl" if learner.device.startswith("cuda") else "gloo",
            bucket_bytes=learner.broadcast_bucket_mb << 20,
            pause_mode=generator.pause_mode,
            abort=generator.interrupt == "resubmit",
            timeout_s=learner.broadcast_timeout_s,
        )

    @property
    def active(self) -> bool:
        return self.broadcaster.usable

    async def open(self) -> None:
        """Form the group; if that fails, log it and sync by disk."""
        try:
            await self.broadcaster.init()
        except Exception as exc:  # any failure to form the group: sync by disk
            log.warning("weight broadcast unavailable: syncing by disk", servers=self.urls,
                        error=repr(exc))  # fmt: skip
            return
        log.info("weight broadcast group formed", servers=self.urls,
                 backend=self.broadcaster.backend)  # fmt: skip

    async def push(self, model: torch.nn.Module, path: str, version: int) -> str:
        """Send ``version`` (saved at ``path``) to every server; returns how it got there:
        "broadcast", "disk" (the broadcast failed: reloaded from ``path``) or "" (no group:
        the generators load it from disk)."""
        if not self.active:
            return ""
        started = time.perf_counter()
        try:
            await self.broadcaster.broadcast(named_tensors(model), version)
        except BroadcastFailed as exc:
            log.warning("weight broadcast failed: reloading from disk, syncing by disk from now",
                        policy_version=version, error=str(exc))  # fmt: skip
            done = await self.broadcaster.reload_from_disk(path, version)
            log.info("servers reloaded from disk", policy_version=version, servers=done)
            return "disk"
        log.info("weights broadcast", policy_version=version, servers=len(self.urls),
                 seconds=round(time.perf_counter() - started, 3))  # fmt: skip
        return "broadcast"
