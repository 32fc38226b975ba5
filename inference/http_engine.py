"""What every engine over inference servers does, whatever the servers speak.

:class:`HTTPEngine` is the :class:`~inference.engine.Engine` over one or more HTTP inference
servers; a subclass speaks one server's protocol (:class:`inference.sglang_client.SGLangEngine`:
SGLang and ``streamrl serve-model``; :class:`inference.vllm_client.VLLMEngine`: vLLM) through
three methods: :meth:`~HTTPEngine._request` (a batch of prompts on one server, as
completions), :meth:`~HTTPEngine._serving_version` and :meth:`~HTTPEngine._load` (pause, load
a weights directory, label it, continue).

Guarantees, whatever the protocol:
- with several servers the engine balances: the least-loaded healthy server (requests in
  flight from this client), sticky per ``session`` (an episode id) so a multi-turn episode
  reuses one server's prefix cache; with ``router_url`` every request goes to the router;
- a server that fails (connection error, 5xx) is taken out of rotation and the request is
  tried on the next healthy one; when none is left :class:`ServerUnavailable` is raised:
  the caller's message is retried, the run does not fail. :meth:`~HTTPEngine.serve_health_checks`
  probes ``/health`` and brings a server back only after it serves the current weight version
  (a server that restarted serves its initial weights: it loads the current ones first);
- ``update_weights`` loads the new version on every healthy server at once; a server that
  misses it is taken out and re-synced by the health checks before it takes work again (so
  does a replica that joins mid-run);
- interruptible rollouts: an update does not wait for long generations. With
  ``interrupt="resubmit"`` (the portable default) the running requests are aborted and
  answered with their tokens so far; each is resubmitted, once the update is done, as
  ``prompt + tokens so far`` with the ``max_new_tokens`` left (up to :data:`MAX_RESUBMITS`
  times, else :class:`ServerUnavailable`), so every token's logprob was computed by one
  version's weights over the whole context. With ``interrupt="in_place"`` running requests go
  on under the new weights on the server, which must say which tokens came from which
  version (per-token version spans). Either way every token of a :class:`Completion` carries
  the version that produced it (``versions``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
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

MAX_STICKY = 10_000
MAX_RESUBMITS = 8  # aborted answers resumed per prompt before the request counts as failed
INTERRUPT_MODES = ("resubmit", "in_place")


class ServerUnavailable(RuntimeError):
    """No healthy server could answer; retry the message later."""


class ProtocolError(ValueError):
    """A server's answer does not have the shape its protocol promises."""


def parse_version(value: Any) -> int:
    """A server's weight version label as an int ("default" before any update: 0)."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def version_spans(spans: Any, n: int, default: Any) -> np.ndarray:
    """Per-token versions of ``n`` tokens from ``[{"version", "start", "end"}, ...]`` spans
    (they must cover the tokens in order), or ``default`` for all when there are none."""
    if not spans:
        return np.full(n, parse_version(default), dtype=np.int32)
    versions = np.empty(n, dtype=np.int32)
    at = 0
    for r in spans:
        start, end = int(r["start"]), int(r["end"])
        if start != at or not start < end <= n:
            raise ProtocolError(f"weight version spans do not cover the tokens: {spans}")
        versions[start:end] = parse_version(r["version"])
        at = end
    if at != n:
        raise ProtocolError(f"weight version spans do not cover the tokens: {spans}")
    return versions


@dataclass(eq=False)
class Server:
    url: str
    healthy: bool = False
    inflight: int = 0
    weight_version: int | None = None  # the version this server was last seen serving
    syncing: bool = False  # a weight update to it is under way
    loading: trio.Lock = field(default_factory=trio.Lock)  # one weight update at a time

    def __repr__(self) -> str:
        return f"Server({self.url}, healthy={self.healthy}, v={self.weight_version})"


def join_parts(parts: list[Completion]) -> Completion:
    """The pieces of one interrupted completion, as one (the last piece's finish reason).
    The text is the pieces' texts joined (each decoded on its own)."""
    versions = np.concatenate([p.token_versions() for p in parts]).astype(np.int32)
    return Completion(
        tokens=np.concatenate([p.tokens for p in parts]).astype(np.int32),
        logprobs=np.concatenate([p.logprobs for p in parts]).astype(np.float32),
        text="".join(p.text for p in parts),
        finish_reason=parts[-1].finish_reason,
        weight_version=int(versions[0]) if len(versions) else parts[0].weight_version,
        versions=versions,
    )


class HTTPEngine:
    """See the module docstring; a subclass speaks one protocol."""

    kind = "http"

    def __init__(self, client: httpx.AsyncClient, urls: Sequence[str], *,
                 router_url: str = "", interrupt: str = "resubmit",
                 vocab_size: int = 0) -> None:
        if not urls and not router_url:
            raise ValueError("need at least one server URL or a router URL")
        if interrupt not in INTERRUPT_MODES:
            raise ValueError(f"interrupt {interrupt!r}: use one of {INTERRUPT_MODES}")
        self.interrupt = interrupt
        self.vocab_size = vocab_size
        """Token ids at or above it are refused before they are sent (0: not checked): SGLang
        0.5 dies on one (an IndexError in its scheduler takes the server down)."""
        self._updates = 0  # weight updates under way
        self._updated = trio.Event()  # set while no update is under way
        self._updated.set()
        self.resubmits = 0  # aborted requests resumed (statistics)
        self.client = client
        self.servers = [Server(u.rstrip("/")) for u in urls]
        self.router = Server(router_url.rstrip("/"), healthy=True) if router_url else None
        self._sticky: OrderedDict[str, Server] = OrderedDict()
        self._target: tuple[str, int] | None = None  # (path, version) every server must serve
        self._version = 0

    # ------------------------------------------------------------------ protocol

    async def _request(self, server: Server, prompts: list[list[int]],
                       sampling: Sampling) -> list[Completion]:
        """One completion per prompt from ``server``, in order; ``finish_reason`` "abort"
        for a request a weight update interrupted (its tokens so far).
        :class:`ServerUnavailable` if the server failed (the next one is tried)."""
        raise NotImplementedError

    async def _serving_version(self, server: Server) -> int:
        """The weight version ``server`` serves now (0 before any update)."""
        raise NotImplementedError

    async def _load(self, server: Server, path: str, version: int) -> None:
        """Have ``server`` serve the weights in ``path`` as ``version``: pause it (aborting
        running requests with ``interrupt="resubmit"``), load, label, continue (the last
        also when loading failed). Raises if it did not."""
        raise NotImplementedError

    # ------------------------------------------------------------------ Engine API

    @property
    def weight_version(self) -> int:
        return self._version

    async def generate(self, prompts: list[list[int]], sampling: Sampling, *,
                       session: str | None = None) -> list[Completion]:
        if not prompts:
            return []
        prompts = [list(map(int, p)) for p in prompts]
        if self.vocab_size:
            for p in prompts:
                if p and not 0 <= min(p) <= max(p) < self.vocab_size:
                    raise ValueError(f"a prompt token id is outside the vocabulary "
                                     f"(0..{self.vocab_size - 1}): {min(p)}..{max(p)}")
        completions = await self._generate(prompts, sampling, session)
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
                return replace(join_parts(parts), finish_reason="length")
            so_far = [*prompt, *(int(t) for p in parts for t in p.tokens)]
            self.resubmits += 1
            log.info("resubmitting an interrupted request", tokens_so_far=done, left=left)
            rest = msgspec.structs.replace(sampling, max_new_tokens=left)
            [answer] = await self._generate([so_far], rest, session)
            parts.append(answer)
            if answer.finish_reason != "abort":
                return join_parts(parts)
        raise ServerUnavailable(f"a request was aborted {MAX_RESUBMITS + 1} times")

    async def _generate(self, prompts: list[list[int]], sampling: Sampling,
                        session: str | None) -> list[Completion]:
        """The batch on one healthy server (the next one if it fails)."""
        tried: set[int] = set()
        while True:
            server = self._pick(session, tried)
            if server is None:
                raise ServerUnavailable(f"no healthy server among {self.servers}")
            tried.add(id(server))
            server.inflight += 1
            try:
                completions = await self._request(server, prompts, sampling)
            except ServerUnavailable as exc:
                log.warning("server failed", url=server.url, error=str(exc))
                if server is not self.router:
                    server.healthy = False
                    if session is not None:
                        self._sticky.pop(session, None)
                continue
            finally:
                server.inflight -= 1
            if len(completions) != len(prompts):
                raise ProtocolError(f"expected {len(prompts)} answers from {server.url}")
            return completions

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
                    server.weight_version = await self._serving_version(server)
        except (httpx.HTTPError, trio.TooSlowError, ValueError, ServerUnavailable):
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
        """Load the target version on ``server``, unless it serves that version or a newer
        one already (the learner broadcast it, or the sync this one waited for loaded it);
        marks the server healthy iff it ends up serving the target version or a newer one.
        One at a time per server: a health check that finds the server behind while an
        update is loading it waits for that load instead of starting a second one (two
        overlapping ``update_weights_from_disk`` killed a real SGLang server: its tokenizer
        manager holds one pending update result, and the second answer raised
        ``InvalidStateError`` in its event loop)."""
        async with server.loading:
            await self._sync_locked(server)

    async def _sync_locked(self, server: Server) -> None:
        assert self._target is not None
        path, version = self._target
        server.syncing = True
        try:
            with trio.fail_after(10):
                serving = await self._serving_version(server)
            if serving >= version:
                server.weight_version = serving
                server.healthy = True
                log.info("server serves the version already", url=server.url,
                         weight_version=serving)
                return
            await self._load(server, path, version)
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

    async def _post(self, server: Server, path: str, body: dict[str, Any] | None = None, *,
                    params: dict[str, str] | None = None) -> dict[str, Any]:
        """POST to an idempotent control endpoint; retried once on a fresh connection if a
        pooled keep-alive connection turns out to be closed."""
        kwargs: dict[str, Any] = {"json": body if body is not None else {}}
        if params:
            kwargs["params"] = params
        try:
            try:
                response = await self.client.post(server.url + path, **kwargs)
            except httpx.RemoteProtocolError:
                response = await self.client.post(server.url + path, **kwargs)
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

    async def _post_answer(self, server: Server, path: str, body: dict[str, Any]) -> Any:
        """POST a generation request; the answer's JSON. :class:`ServerUnavailable` for a
        transport error or a 5xx (the next server is tried), ``ValueError`` for a 4xx (the
        request itself is wrong: no server would take it)."""
        try:
            response = await self.client.post(server.url + path, json=body)
        except httpx.TransportError as exc:
            raise ServerUnavailable(f"{server.url}: {exc!r}") from exc
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
async def open_http_engine(make: Callable[[httpx.AsyncClient], HTTPEngine], *,
                           health_interval_s: float, request_timeout_s: float,
                           max_connections: int = 256,
                           max_keepalive: int = 64) -> AsyncIterator[Any]:
    """``make(client)``'s engine with its health checks running (one probe done before it
    is handed out); the HTTP client and the checks end with the block."""
    timeout = httpx.Timeout(request_timeout_s, connect=5.0)
    limits = httpx.Limits(max_connections=max_connections,
                          max_keepalive_connections=max_keepalive)
    async with (
        httpx.AsyncClient(timeout=timeout, limits=limits) as client,
        trio.open_nursery() as nursery,
    ):
        engine = make(client)
        await nursery.start(engine.serve_health_checks, health_interval_s)
        try:
            yield engine
        finally:
            nursery.cancel_scope.cancel()
