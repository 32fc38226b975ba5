"""The SGLang HTTP client behind the :class:`~inference.engine.Engine` interface.

One client speaks to SGLang servers (GPU) and to ``streamrl serve-model`` (CPU) alike,
through the protocol subset in ``shared/reference/sglang.md``. Balancing, stickiness per
episode, health checks, re-syncing a server that comes back and interruptible rollouts are
:class:`~inference.http_engine.HTTPEngine`'s (every engine over servers shares them); this
module is SGLang's protocol:

- ``generate`` sends one batched ``/generate`` (``input_ids``, ``return_logprob``,
  ``logprob_start_len=-1``) and returns one :class:`Completion` per prompt whose logprobs,
  finish reason and weight version are read from ``meta_info``; an answer that does not
  have that shape raises :class:`ProtocolError` (server data is untrusted). Per-token
  versions come from ``meta_info.weight_versions`` ranges if present (``serve-model``, for
  ``interrupt="in_place"``), else ``weight_version`` for all its tokens;
- a weight update is ``pause_generation -> [abort_request abort_all] ->
  update_weights_from_disk(weight_version=N) -> continue_generation`` (the abort with
  ``interrupt="resubmit"``: aborted answers keep their tokens and are resubmitted);
- renamed endpoints are tried under the new name, then the old one on 404
  (``/model_info`` -> ``/get_model_info``, ``/server_info`` -> ``/get_server_info``).

The learner's broadcast path (:class:`WeightBroadcaster`, SGLang's weight-update group) is
here too.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from functools import partial
from typing import Any

import httpx
import numpy as np
import structlog
import trio

from streamrl.inference.engine import Completion
from streamrl.inference.http_engine import (
    INTERRUPT_MODES,
    MAX_RESUBMITS,
    HTTPEngine,
    ProtocolError,
    Server,
    ServerUnavailable,
    join_parts,
    open_http_engine,
    parse_version,
    version_spans,
)
from streamrl.protocol.messages import Sampling

__all__ = ["INTERRUPT_MODES", "MAX_RESUBMITS", "ProtocolError", "SGLangEngine",
           "ServerUnavailable", "open_sglang_engine", "parse_version"]

log = structlog.get_logger()

RENAMED = {"/model_info": "/get_model_info", "/server_info": "/get_server_info"}


def _versions(meta: dict[str, Any], n: int) -> np.ndarray:
    """Per-token versions: from ``weight_versions`` ranges when the server reports them
    (they must cover the tokens in order), else ``weight_version`` for all."""
    return version_spans(meta.get("weight_versions"), n, meta.get("weight_version"))


def _completion(answer: Any) -> Completion:
    """One answer as a :class:`Completion`; ``finish_reason`` may be ``abort`` (the tokens so
    far, to be resumed)."""
    try:
        meta = answer["meta_info"]
        tokens = np.asarray(answer["output_ids"], dtype=np.int32)
        pairs = meta["output_token_logprobs"]
        logprobs = np.asarray([float(p[0]) for p in pairs], dtype=np.float32)
        if [int(p[1]) for p in pairs] != tokens.tolist():
            raise ProtocolError("output_token_logprobs do not match output_ids")
        reason = meta["finish_reason"]["type"]
        text = str(answer["text"])
        versions = _versions(meta, len(tokens))
        version = int(versions[0]) if len(tokens) else parse_version(meta.get("weight_version"))
    except (KeyError, TypeError, IndexError, ValueError) as exc:
        if isinstance(exc, ProtocolError):
            raise
        raise ProtocolError(f"malformed /generate answer: {exc!r}") from None
    if reason not in ("stop", "length", "abort"):
        raise ProtocolError(f"unknown finish_reason {meta['finish_reason']}")
    return Completion(tokens=tokens, logprobs=logprobs, text=text, finish_reason=reason,
                      weight_version=version, versions=versions)


def _aborted_at(c: Completion, sent: int | None) -> Completion:
    """An answer aborted by a weight update (``interrupt="resubmit"``) whose tokens carry no
    per-token versions: SGLang 0.5 stamps it with the version it serves when it answers,
    the new one, although every token was sampled before the pause, by the weights served
    when the request was sent. Those are its tokens' version."""
    if c.finish_reason != "abort" or sent is None or not len(c.tokens):
        return c
    versions = c.token_versions()
    if int(versions.min()) <= sent:
        return c
    return replace(c, weight_version=sent, versions=np.full(len(c.tokens), sent, np.int32))


class SGLangEngine(HTTPEngine):
    """See the module docstring. Use :func:`open_sglang_engine`."""

    kind = "sglang"

    def __init__(self, client: httpx.AsyncClient, urls: Sequence[str], *,
                 router_url: str = "", pause_mode: str = "in_place",
                 interrupt: str = "resubmit", vocab_size: int = 0) -> None:
        super().__init__(client, urls, router_url=router_url, interrupt=interrupt,
                         vocab_size=vocab_size)
        self.pause_mode = pause_mode

    async def _request(self, server: Server, prompts: list[list[int]],
                       sampling: Sampling) -> list[Completion]:
        """One batched /generate."""
        body: dict[str, Any] = {
            "input_ids": prompts,
            "sampling_params": {"max_new_tokens": sampling.max_new_tokens,
                                "temperature": sampling.temperature, "top_p": sampling.top_p},
            "return_logprob": True,
            "logprob_start_len": -1,
            "rid": uuid.uuid4().hex,
        }
        if sampling.seed is not None:
            body["sampling_params"]["sampling_seed"] = sampling.seed
        sent = server.weight_version  # what the server served when the request left
        answers = await self._post_answer(server, "/generate", body)
        if not isinstance(answers, list) or len(answers) != len(prompts):
            raise ProtocolError(f"expected {len(prompts)} answers from {server.url}")
        return [_aborted_at(_completion(a), sent) for a in answers]

    async def _serving_version(self, server: Server) -> int:
        info = await self.get_json(server, "/model_info")
        return parse_version(info.get("weight_version"))

    async def _load(self, server: Server, path: str, version: int) -> None:
        """pause -> [abort] -> update_weights_from_disk -> continue."""
        # resubmit: running requests are aborted anyway, and the server must be idle for its
        # prefix cache to be flushed (below)
        mode = "abort" if self.interrupt == "resubmit" else self.pause_mode
        await self._post(server, "/pause_generation", {"mode": mode})
        try:
            if self.interrupt == "resubmit":  # answered with their tokens so far
                await self._post(server, "/abort_request", {"abort_all": True})
            answer = await self._post(server, "/update_weights_from_disk", {
                "model_path": path, "weight_version": str(version),
                "flush_cache": self.pause_mode != "in_place",
            })
            if self.interrupt == "resubmit" and answer.get("success"):
                await self._flush(server)
        finally:
            with trio.CancelScope(shield=True):
                await self._post(server, "/continue_generation", {})
        if not answer.get("success"):
            raise ProtocolError(f"update refused: {answer.get('message')}")

    async def _flush(self, server: Server, timeout_s: float = 10.0) -> None:
        """Empty the server's prefix cache once the aborted requests have drained: its keys
        and values were computed by the old weights, and a new request with a cached prefix
        would be served them (SGLang caches prefixes across requests, serve-model does not).
        SGLang answers 400 while requests still hold cache entries (asked within its weight
        update instead, ``flush_cache``, it asserts and the server dies), so it is asked
        until it has."""
        with trio.fail_after(timeout_s):
            while True:
                response = await self.client.post(server.url + "/flush_cache")
                if response.status_code == 200:
                    return
                if response.status_code != 400:
                    raise ProtocolError(f"/flush_cache: HTTP {response.status_code}")
                await trio.sleep(0.05)

    async def get_json(self, server: Server, path: str) -> dict[str, Any]:
        """GET a control endpoint, under its old name if the new one is a 404."""
        response = await self.client.get(server.url + path)
        if response.status_code == 404 and path in RENAMED:
            response = await self.client.get(server.url + RENAMED[path])
        response.raise_for_status()
        data = response.json()
        if not isinstance(data, dict):
            raise ProtocolError(f"{path}: expected a JSON object")
        return data


_join = join_parts  # the pieces of one interrupted completion (tests use the old name)


@asynccontextmanager
async def open_sglang_engine(
    urls: Sequence[str], *, router_url: str = "", health_interval_s: float = 2.0,
    request_timeout_s: float = 600.0, pause_mode: str = "in_place",
    interrupt: str = "resubmit", vocab_size: int = 0,
) -> AsyncIterator[SGLangEngine]:
    """A client with its health checks running (one probe done before it is handed out)."""
    def make(client: httpx.AsyncClient) -> SGLangEngine:
        return SGLangEngine(client, urls, router_url=router_url, pause_mode=pause_mode,
                            interrupt=interrupt, vocab_size=vocab_size)

    async with open_http_engine(make, health_interval_s=health_interval_s,
                                request_timeout_s=request_timeout_s) as engine:
        yield engine


# ---------------------------------------------------------------------------- broadcast path


def open_process_group(address: str, port: int, rank: int, world_size: int, group_name: str,
                       timeout_s: float = 120.0, backend: str = "gloo") -> Any:
    """A standalone process group (no global ``init_process_group``): rank 0 hosts the
    store. Blocks until every rank has joined. ``backend``: "gloo" (CPU tensors) or "nccl"
    (CUDA tensors; the learner on a GPU)."""
    from datetime import timedelta

    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(address, port, world_size, is_master=rank == 0, timeout=timeout)
    prefixed = dist.PrefixStore(group_name, store)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)


def broadcast_tensor(group: Any, tensor: Any) -> None:
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def buckets(tensors: dict[str, Any], bucket_bytes: int) -> list[list[str]]:
    """The names of ``tensors`` in order, cut into buckets of at most ``bucket_bytes`` (a
    tensor larger than that is a bucket of its own)."""
    out: list[list[str]] = []
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if not out or (size + n > bucket_bytes and out[-1]):
            out.append([])
            size = 0
        out[-1].append(name)
        size += n
    return out


class BroadcastFailed(RuntimeError):
    """A broadcast did not reach every server; they stay paused until a reload from disk."""


class WeightBroadcaster:
    """The learner's side (rank 0) of SGLang's weight-update group: ``init`` has every server
    join (``/init_weights_update_group``, server ``i`` is rank ``1 + i``); ``broadcast``
    pauses them (``pause_mode``; with ``abort``, running requests are aborted and answered
    with their tokens so far, for the client to resubmit), then sends the tensors bucket by
    bucket (one ``/update_weights_from_distributed`` per bucket of at most ``bucket_bytes``,
    the version label on the last one), and lets them continue. gloo on CPU; on GPUs the same
    calls with ``backend="nccl"`` and CUDA tensors.

    A failed broadcast (a server gone, an error, ``timeout_s`` passed) raises
    :class:`BroadcastFailed` and leaves the servers paused (some may hold part of the new
    weights under the old label): the generators' reload from disk
    (:meth:`SGLangEngine.update_weights`) pauses, loads and continues each of them. The group
    is then unusable (``usable`` False)."""

    def __init__(self, client: httpx.AsyncClient, urls: Sequence[str], *, master_port: int,
                 master_address: str = "127.0.0.1", group_name: str = "weight_update_group",
                 backend: str = "gloo", bucket_bytes: int = 512 << 20,
                 pause_mode: str = "in_place", abort: bool = False,
                 timeout_s: float = 120.0) -> None:
        self.client = client
        self.urls = [u.rstrip("/") for u in urls]
        self.master_address, self.master_port = master_address, master_port
        self.group_name, self.backend = group_name, backend
        self.bucket_bytes, self.pause_mode, self.abort = bucket_bytes, pause_mode, abort
        self.timeout_s = timeout_s
        self.group: Any = None
        self.usable = False

    async def _post(self, url: str, body: dict[str, Any]) -> None:
        response = await self.client.post(url, json=body)
        data = response.json() if response.content else {}
        if response.status_code != 200 or data.get("success") is False:
            raise ProtocolError(f"{url}: HTTP {response.status_code} {data}")

    async def init(self) -> None:
        """Form the group with every server; raises (and stays unusable) if one cannot join
        within ``timeout_s``."""
        world = 1 + len(self.urls)

        def join() -> None:
            self.group = open_process_group(self.master_address, self.master_port, 0, world,
                                            self.group_name, self.timeout_s, self.backend)

        with trio.fail_after(self.timeout_s + 5):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(partial(trio.to_thread.run_sync, join, abandon_on_cancel=True))
                for i, url in enumerate(self.urls):
                    nursery.start_soon(self._post, url + "/init_weights_update_group", {
                        "master_address": self.master_address, "master_port": self.master_port,
                        "rank_offset": 1 + i, "world_size": world, "group_name": self.group_name,
                        "backend": self.backend,
                    })
        self.usable = True

    async def broadcast(self, tensors: dict[str, Any], version: int) -> None:
        """Every server serves ``tensors`` as ``version`` when this returns."""
        if not self.usable:
            raise RuntimeError("no usable weight-update group: call init() first")
        parts = buckets(tensors, self.bucket_bytes)
        try:
            with trio.fail_after(self.timeout_s):
                async with trio.open_nursery() as nursery:
                    for url in self.urls:
                        nursery.start_soon(self._pause, url)
                for i, names in enumerate(parts):
                    await self._send(tensors, names, version if i == len(parts) - 1 else None)
        except (httpx.HTTPError, ProtocolError, RuntimeError, trio.TooSlowError) as exc:
            self.usable = False
            raise BroadcastFailed(f"weights version {version}: {exc!r}") from exc
        except BaseExceptionGroup as group:
            self.usable = False
            raise BroadcastFailed(f"weights version {version}: {group!r}") from group
        await self._continue_all()

    async def _continue_all(self) -> None:
        async def one(url: str) -> None:
            try:
                with trio.fail_after(10):
                    await self._post(url + "/continue_generation", {})
            except (httpx.HTTPError, ProtocolError, trio.TooSlowError) as exc:
                log.warning("continue_generation failed", url=url, error=repr(exc))

        async with trio.open_nursery() as nursery:
            for url in self.urls:
                nursery.start_soon(one, url)

    async def reload_from_disk(self, path: str, version: int) -> list[str]:
        """After a failed broadcast: have every server load ``path`` as ``version`` and
        continue (the servers it cannot reach load it from disk when they are back, as any
        late joiner does); returns the URLs that did."""
        done: list[str] = []

        async def one(url: str) -> None:
            try:
                with trio.fail_after(self.timeout_s):
                    await self._post(url + "/update_weights_from_disk", {
                        "model_path": path, "weight_version": str(version), "flush_cache": True,
                    })
                done.append(url)
            except (httpx.HTTPError, ProtocolError, trio.TooSlowError) as exc:
                log.warning("reload from disk failed", url=url, error=repr(exc))

        async with trio.open_nursery() as nursery:
            for url in self.urls:
                nursery.start_soon(one, url)
        await self._continue_all()
        return done

    async def _pause(self, url: str) -> None:
        await self._post(url + "/pause_generation", {"mode": self.pause_mode})
        if self.abort:
            await self._post(url + "/abort_request", {"abort_all": True})

    async def _send(self, tensors: dict[str, Any], names: list[str], version: int | None) -> None:
        body: dict[str, Any] = {
            "names": names, "dtypes": [str(tensors[n].dtype).removeprefix("torch.")
                                       for n in names],
            "shapes": [list(tensors[n].shape) for n in names], "group_name": self.group_name,
            "flush_cache": version is not None,
        }
        if version is not None:
            body["weight_version"] = str(version)

        def send() -> None:
            for n in names:
                tensor = tensors[n].detach()
                if self.backend == "nccl":  # NCCL sends CUDA tensors (the snapshot is on CPU)
                    tensor = tensor.to("cuda")
                broadcast_tensor(self.group, tensor.contiguous())

        async with trio.open_nursery() as nursery:
            for url in self.urls:
                nursery.start_soon(self._post, url + "/update_weights_from_distributed", body)
            nursery.start_soon(partial(trio.to_thread.run_sync, send, abandon_on_cancel=True))
