"""The SGLang HTTP client behind the :class:`~inference.engine.Engine` interface.

One client speaks to SGLang servers (GPU) and to ``streamrl serve-model`` (CPU) alike,
through the protocol subset in ``shared/reference/sglang.md``.

Guarantees:
- ``generate`` sends one batched ``/generate`` (``input_ids``, ``return_logprob``,
  ``logprob_start_len=-1``) and returns one :class:`Completion` per prompt whose logprobs,
  finish reason and weight version are read from ``meta_info``; an answer that does not
  have that shape raises :class:`ProtocolError` (server data is untrusted);
- with several servers the client balances: the least-loaded healthy server (requests in
  flight from this client), sticky per ``session`` (an episode id) so a multi-turn episode
  reuses one server's prefix cache; with ``router_url`` every request goes to the router;
- a server that fails (connection error, 5xx) is taken out of rotation and the request is
  tried on the next healthy one; when none is left :class:`ServerUnavailable` is raised:
  the caller's message is retried, the run does not fail.
  :meth:`SGLangEngine.serve_health_checks` probes ``/health`` and brings a server back only
  after it serves the current weight version;
- ``update_weights`` runs ``pause_generation -> update_weights_from_disk(weight_version=N)
  -> continue_generation`` on every server at once; a server that misses it is taken out
  and re-synced by the health checks before it takes work again (so does a replica that
  joins mid-run);
- interruptible rollouts: an update does not wait for long generations. With
  ``interrupt="resubmit"`` (the portable default) it aborts the running requests
  (``/abort_request`` ``abort_all`` after the pause); an aborted answer keeps its tokens and
  the request is resubmitted, once the update is done, as ``input_ids + tokens so far``
  with the ``max_new_tokens`` left (up to :data:`MAX_RESUBMITS` times, else
  :class:`ServerUnavailable`). With ``interrupt="in_place"`` running requests go on under
  the new weights on the server, which must then say which tokens came from which version
  (``meta_info.weight_versions``, as ``serve-model`` does). Either way every token of a
  :class:`Completion` carries the version that produced it (``versions``), read from the
  answers: ``weight_versions`` ranges if present, else ``weight_version`` for all its tokens;
- renamed endpoints are tried under the new name, then the old one on 404
  (``/model_info`` -> ``/get_model_info``, ``/server_info`` -> ``/get_server_info``).
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np
import structlog
import trio

from streamrl.inference.engine import Completion
from streamrl.protocol.messages import Sampling

log = structlog.get_logger()

RENAMED = {"/model_info": "/get_model_info", "/server_info": "/get_server_info"}
MAX_STICKY = 10_000
MAX_RESUBMITS = 8  # aborted answers resumed per prompt before the request counts as failed
INTERRUPT_MODES = ("resubmit", "in_place")


class ServerUnavailable(RuntimeError):
    """No healthy server could answer; retry the message later."""


class ProtocolError(ValueError):
    """A server's answer does not have the SGLang shape."""


def parse_version(value: Any) -> int:
    """SGLang's ``weight_version`` is a string ("default" before any update)."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


@dataclass(eq=False)
class Server:
    url: str
    healthy: bool = False
    inflight: int = 0
    weight_version: int | None = None  # the version this server was last seen serving
    syncing: bool = False  # a weight update to it is under way

    def __repr__(self) -> str:
        return f"Server({self.url}, healthy={self.healthy}, v={self.weight_version})"


def _versions(meta: dict[str, Any], n: int) -> np.ndarray:
    """Per-token versions: from ``weight_versions`` ranges when the server reports them
    (they must cover the tokens in order), else ``weight_version`` for all."""
    ranges = meta.get("weight_versions")
    if not ranges:
        return np.full(n, parse_version(meta.get("weight_version")), dtype=np.int32)
    versions = np.empty(n, dtype=np.int32)
    at = 0
    for r in ranges:
        start, end = int(r["start"]), int(r["end"])
        if start != at or not start < end <= n:
            raise ProtocolError(f"weight_versions do not cover the tokens: {ranges}")
        versions[start:end] = parse_version(r["version"])
        at = end
    if at != n:
        raise ProtocolError(f"weight_versions do not cover the tokens: {ranges}")
    return versions


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


def _join(parts: list[Completion]) -> Completion:
    """The pieces of one interrupted completion, as one (the last piece's finish reason).
    The text is the pieces' texts joined (each decoded by the server on its own)."""
    versions = np.concatenate([p.token_versions() for p in parts]).astype(np.int32)
    return Completion(
        tokens=np.concatenate([p.tokens for p in parts]).astype(np.int32),
        logprobs=np.concatenate([p.logprobs for p in parts]).astype(np.float32),
        text="".join(p.text for p in parts),
        finish_reason=parts[-1].finish_reason,
        weight_version=int(versions[0]) if len(versions) else parts[0].weight_version,
        versions=versions,
    )


class SGLangEngine:
    """See the module docstring. Use :func:`open_sglang_engine`."""

    def __init__(self, client: httpx.AsyncClient, urls: Sequence[str], *,
                 router_url: str = "", pause_mode: str = "in_place",
                 interrupt: str = "resubmit") -> None:
        if not urls and not router_url:
            raise ValueError("need at least one server URL or a router URL")
        if interrupt not in INTERRUPT_MODES:
            raise ValueError(f"interrupt {interrupt!r}: use one of {INTERRUPT_MODES}")
        self.interrupt = interrupt
        self._updates = 0  # weight updates under way
        self._updated = trio.Event()  # set while no update is under way
        self._updated.set()
        self.resubmits = 0  # aborted requests resumed (statistics)
        self.client = client
        self.servers = [Server(u.rstrip("/")) for u in urls]
        self.router = Server(router_url.rstrip("/"), healthy=True) if router_url else None
        self.pause_mode = pause_mode
        self._sticky: OrderedDict[str, Server] = OrderedDict()
        self._target: tuple[str, int] | None = None  # (path, version) every server must serve
        self._version = 0
        self._sync_lock = trio.Lock()

    # ------------------------------------------------------------------ Engine API

    @property
    def weight_version(self) -> int:
        return self._version

    async def generate(self, prompts: list[list[int]], sampling: Sampling, *,
                       session: str | None = None) -> list[Completion]:
        if not prompts:
            return []
        prompts = [list(map(int, p)) for p in prompts]
        answers = await self._generate(prompts, sampling, session)
        completions = [_completion(a) for a in answers]
        if all(c.finish_reason != "abort" for c in completions):
            return completions

        async def resume(i: int) -> None:
            completions[i] = await self._resume(prompts[i], completions[i], sampling, session)

        async with trio.open_nursery() as nursery:
            for i, c in enumerate(completions):
                if c.finish_reason == "abort":
                    nursery.start_soon(resume, i)
        return completions

    async def _resume(self, prompt: list[int], first: Completion, sampling: Sampling,
                      session: str | None) -> Completion:
        """Resubmit an aborted request as prompt + tokens so far, after the weight update
        that aborted it, until it finishes."""
        parts = [first]
        for _ in range(MAX_RESUBMITS):
            await self._updated.wait()
            done = sum(len(p.tokens) for p in parts)
            left = sampling.max_new_tokens - done
            if left <= 0:
                return replace(_join(parts), finish_reason="length")
            so_far = [*prompt, *(int(t) for p in parts for t in p.tokens)]
            self.resubmits += 1
            log.info("resubmitting an interrupted request", tokens_so_far=done, left=left)
            rest = msgspec.structs.replace(sampling, max_new_tokens=left)
            [answer] = await self._generate([so_far], rest, session)
            parts.append(_completion(answer))
            if parts[-1].finish_reason != "abort":
                return _join(parts)
        raise ServerUnavailable(f"a request was aborted {MAX_RESUBMITS + 1} times")

    async def _generate(self, prompts: list[list[int]], sampling: Sampling,
                        session: str | None) -> list[Any]:
        """One batched /generate on a healthy server (the next one if it fails)."""
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
        tried: set[int] = set()
        while True:
            server = self._pick(session, tried)
            if server is None:
                raise ServerUnavailable(f"no healthy server among {self.servers}")
            tried.add(id(server))
            try:
                answers = await self._post_generate(server, body)
            except ServerUnavailable as exc:
                log.warning("server failed", url=server.url, error=str(exc))
                if server is not self.router:
                    server.healthy = False
                    if session is not None:
                        self._sticky.pop(session, None)
                continue
            if not isinstance(answers, list) or len(answers) != len(prompts):
                raise ProtocolError(f"expected {len(prompts)} answers from {server.url}")
            return answers

    async def update_weights(self, path: str | Path, version: int) -> None:
        """Every healthy server serves ``version`` when this returns; raises
        :class:`ServerUnavailable` if none could load it. Requests it interrupts are
        resubmitted once it returns (``interrupt="resubmit"``)."""
        self._target = (str(path), version)
        healthy = [s for s in self.servers if s.healthy] or ([self.router] if self.router else [])
        if self._updates == 0:
            self._updated = trio.Event()
        self._updates += 1
        try:
            async with trio.open_nursery() as nursery:
                for server in healthy:
                    nursery.start_soon(self._sync_one, server)
        finally:
            self._updates -= 1
            if self._updates == 0:
                self._updated.set()
        self._version = version  # the target: a server that missed it loads it when back
        if self.servers and not any(s.healthy for s in self.servers):
            raise ServerUnavailable(f"no server loaded weights version {version}")

    # ------------------------------------------------------------------ health

    async def check_all(self) -> None:
        """Probe every server once: a dead one goes out; one that answers comes (back) in
        only after it serves the current weights."""
        async with trio.open_nursery() as nursery:
            for server in self.servers:
                nursery.start_soon(self._check, server)

    async def serve_health_checks(self, interval_s: float = 2.0, *,
                                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                                  ) -> None:
        await self.check_all()
        task_status.started()
        while True:
            await trio.sleep(interval_s)
            await self.check_all()

    async def _check(self, server: Server) -> None:
        if server.syncing:
            return
        try:
            with trio.fail_after(5):
                response = await self.client.get(server.url + "/health")
            ok = response.status_code == 200
            if ok:  # a server restarted between probes serves its initial weights again
                with trio.fail_after(5):
                    info = await self.get_json(server, "/model_info")
                server.weight_version = parse_version(info.get("weight_version"))
        except (httpx.HTTPError, trio.TooSlowError, ValueError, ProtocolError):
            ok = False
        if not ok:
            if server.healthy:
                log.warning("server down", url=server.url)
            server.healthy = False
            server.weight_version = None
            return
        if self._target is not None and (server.weight_version or 0) < self._target[1]:
            # behind (a restart serves its initial weights); one ahead of the target got a
            # version the learner broadcast before its event reached us: fine
            await self._sync_one(server)
        elif not server.healthy:
            server.healthy = True
            log.info("server up", url=server.url, weight_version=server.weight_version)

    async def _sync_one(self, server: Server) -> None:
        """pause -> update_weights_from_disk -> continue, unless the server serves the
        target version or a newer one already (the learner broadcast it:
        :class:`WeightBroadcaster`); marks the server healthy iff it ends up serving the
        target version or a newer one."""
        assert self._target is not None
        path, version = self._target
        server.syncing = True
        try:
            with trio.fail_after(10):
                info = await self.get_json(server, "/model_info")
            serving = parse_version(info.get("weight_version"))
            if serving >= version:
                server.weight_version = serving
                server.healthy = True
                log.info("server serves the version already", url=server.url,
                         weight_version=serving)
                return
            await self._post(server, "/pause_generation", {"mode": self.pause_mode})
            try:
                if self.interrupt == "resubmit":  # answered with their tokens so far
                    await self._post(server, "/abort_request", {"abort_all": True})
                answer = await self._post(server, "/update_weights_from_disk", {
                    "model_path": path, "weight_version": str(version),
                    "flush_cache": self.pause_mode != "in_place",
                })
            finally:
                with trio.CancelScope(shield=True):
                    await self._post(server, "/continue_generation", {})
            if not answer.get("success"):
                raise ProtocolError(f"update refused: {answer.get('message')}")
        except (httpx.HTTPError, ServerUnavailable, ProtocolError, ValueError,
                trio.TooSlowError) as exc:
            log.warning("weight update failed", url=server.url, version=version, error=str(exc))
            server.healthy = False
            server.weight_version = None
            return
        finally:
            server.syncing = False
        server.weight_version = version
        server.healthy = True
        log.info("server weights updated", url=server.url, weight_version=version)

    # ------------------------------------------------------------------ HTTP

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

    async def _post(self, server: Server, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST to an idempotent control endpoint; retried once on a fresh connection if a
        pooled keep-alive connection turns out to be closed."""
        try:
            try:
                response = await self.client.post(server.url + path, json=body)
            except httpx.RemoteProtocolError:
                response = await self.client.post(server.url + path, json=body)
        except httpx.TransportError as exc:
            raise ServerUnavailable(f"{server.url}{path}: {exc!r}") from exc
        if response.status_code >= 500:
            raise ServerUnavailable(f"{server.url}{path}: HTTP {response.status_code}")
        try:
            data = response.json()
        except ValueError:
            data = {}
        if response.status_code >= 400:
            raise ProtocolError(f"{server.url}{path}: HTTP {response.status_code} {data}")
        return data if isinstance(data, dict) else {}

    async def _post_generate(self, server: Server, body: dict[str, Any]) -> Any:
        server.inflight += 1
        try:
            response = await self.client.post(server.url + "/generate", json=body)
        except httpx.TransportError as exc:
            raise ServerUnavailable(f"{server.url}: {exc!r}") from exc
        finally:
            server.inflight -= 1
        if response.status_code >= 500:
            raise ServerUnavailable(f"{server.url}: HTTP {response.status_code}")
        if response.status_code >= 400:
            raise ValueError(f"{server.url} refused the request: {response.text[:500]}")
        try:
            return response.json()
        except ValueError as exc:
            raise ProtocolError(f"{server.url}: answer is not JSON") from exc

    def _pick(self, session: str | None, tried: set[int]) -> Server | None:
        if self.router is not None:
            return None if id(self.router) in tried else self.router
        if session is not None:
            server = self._sticky.get(session)
            if server is not None and server.healthy and id(server) not in tried:
                self._sticky.move_to_end(session)
                return server
        candidates = [s for s in self.servers if s.healthy and id(s) not in tried]
        if not candidates:
            return None
        server = min(candidates, key=lambda s: s.inflight)
        if session is not None:
            self._sticky[session] = server
            if len(self._sticky) > MAX_STICKY:
                self._sticky.popitem(last=False)
        return server


@asynccontextmanager
async def open_sglang_engine(
    urls: Sequence[str], *, router_url: str = "", health_interval_s: float = 2.0,
    request_timeout_s: float = 600.0, pause_mode: str = "in_place",
    interrupt: str = "resubmit",
) -> AsyncIterator[SGLangEngine]:
    """A client with its health checks running (one probe done before it is handed out)."""
    timeout = httpx.Timeout(request_timeout_s, connect=5.0)
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    async with (
        httpx.AsyncClient(timeout=timeout, limits=limits) as client,
        trio.open_nursery() as nursery,
    ):
        engine = SGLangEngine(client, urls, router_url=router_url, pause_mode=pause_mode,
                              interrupt=interrupt)
        await nursery.start(engine.serve_health_checks, health_interval_s)
        try:
            yield engine
        finally:
            nursery.cancel_scope.cancel()


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
