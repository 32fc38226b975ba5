"""``streamrl serve-model``: the SGLang HTTP protocol subset the generator speaks, served on
a CPU from a real transformers model (:class:`~inference.transformers_engine.TransformersEngine`).

It stands in for SGLang (0.5.23, see ``shared/reference/sglang.md``) where there is no GPU:
the embedded default, CI and the router tests run the same client code against it.

Guarantees:
- ``POST /generate`` answers SGLang's shapes: ``{text, output_ids, meta_info}`` (a list of
  them for a batch of ``input_ids``/``text``), ``meta_info`` with ``id``, ``finish_reason``
  (``stop``/``length``/``abort``), ``prompt_tokens``, ``completion_tokens``,
  ``cached_tokens``, ``weight_version``, ``e2e_latency`` and, with ``return_logprob``,
  ``output_token_logprobs`` as ``[[logprob, token_id, null], ...]`` (exact behaviour
  logprobs, see :mod:`inference.engine`);
- concurrent requests share the engine's batches; ``/abort_request`` (by ``rid`` or
  ``abort_all``) ends a request before its next decoding step and answers what it has so
  far (``finish_reason`` ``abort``, with ``output_ids`` and their logprobs, as SGLang does);
  a client that disconnects drops its request's rows;
- ``/pause_generation`` holds new requests (mode ``abort`` also aborts the running ones)
  until ``/continue_generation``; ``/update_weights_from_disk`` does not wait for running
  requests: the new weights apply between two decoding steps and the running requests go
  on under them (interruptible rollouts). An answer whose tokens came from more than one
  version says which: ``meta_info.weight_versions = [{version, start, end}, ...]`` (token
  ranges, ``end`` exclusive, in order); ``weight_version`` is that of the last token;
- both spellings of the renamed endpoints answer (``/model_info`` and ``/get_model_info``,
  ``/server_info`` and ``/get_server_info``).

- ``/init_weights_update_group`` + ``/update_weights_from_distributed`` receive the weights
  from the learner (rank 0) over a gloo group (:class:`inference.sglang_client.WeightBroadcaster`).

What it does not do (400 with a message): streaming, ``top_k``, ``ignore_eos``, prefix
caching (``cached_tokens`` is always 0), NCCL (it runs on the CPU).
``stop`` / ``stop_token_ids`` are applied to the finished completion (the engine decodes
past them; the output is cut at the first match, its logprobs with it).
"""

from __future__ import annotations

import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import structlog
import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from streamrl.inference.engine import Completion
from streamrl.inference.http import guard_connections
from streamrl.inference.transformers_engine import EngineClosed, TransformersEngine
from streamrl.protocol.messages import Sampling

log = structlog.get_logger()
PROTOCOL_VERSION = "0.5.23"  # the SGLang release whose HTTP shapes this server answers
BATCH_WAIT_S = 0.05  # an idle engine waits this long for concurrent requests to batch them


class BadRequest(ValueError):
    pass


@dataclass
class Running:
    """A ``/generate`` in progress: cancelled while it waits for the server to resume,
    aborted (answering its tokens so far) once its rows are in the engine."""

    scope: trio.CancelScope
    abort: threading.Event = field(default_factory=threading.Event)
    in_engine: bool = False

    def stop(self) -> None:
        self.abort.set()
        if not self.in_engine:
            self.scope.cancel()


@dataclass
class ServerState:
    engine: TransformersEngine
    model_path: str
    host: str
    port: int
    weight_version: str = "default"
    labels: dict[int, str] = field(default_factory=dict)  # engine version -> weight_version
    running: dict[str, Running] = field(default_factory=dict)
    aborted: set[str] = field(default_factory=set)
    waiting: int = 0
    groups: dict[str, Any] = field(default_factory=dict)  # weight-update process groups
    updates: dict[str, int] = field(default_factory=lambda: {"disk": 0, "distributed": 0})
    """Weight updates applied, by route (``/server_info``'s ``weight_updates``)."""
    resumed: trio.Event = field(default_factory=trio.Event)

    def __post_init__(self) -> None:
        self.labels[self.engine.weight_version] = self.weight_version
        self.resumed.set()

    @property
    def paused(self) -> bool:
        return not self.resumed.is_set()


# ---------------------------------------------------------------------------- /generate


def _sampling(params: dict[str, Any]) -> tuple[Sampling, list[str], set[int]]:
    unknown_ok = {"max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids",
                  "ignore_eos", "skip_special_tokens", "no_stop_trim", "sampling_seed", "n"}
    extra = set(params) - unknown_ok
    if extra:
        raise BadRequest(f"unsupported sampling_params {sorted(extra)}")
    if params.get("top_k", -1) not in (-1, 0, None):
        raise BadRequest("top_k is not supported by serve-model")
    if params.get("ignore_eos"):
        raise BadRequest("ignore_eos is not supported by serve-model")
    stop = params.get("stop") or []
    stop = [stop] if isinstance(stop, str) else list(stop)
    try:
        sampling = Sampling(
            max_new_tokens=int(params.get("max_new_tokens", 128)),
            temperature=float(params.get("temperature", 1.0)),
            top_p=float(params.get("top_p", 1.0)),
            seed=None if params.get("sampling_seed") is None else int(params["sampling_seed"]),
        )
    except (TypeError, ValueError) as exc:
        raise BadRequest(f"bad sampling_params: {exc}") from None
    return sampling, [str(s) for s in stop], {int(t) for t in params.get("stop_token_ids") or []}


def _prompts(body: dict[str, Any], state: ServerState) -> tuple[list[list[int]], bool]:
    """Token-id prompts and whether the request was a batch."""
    if body.get("input_ids") is not None:
        ids = body["input_ids"]
        batch = bool(ids) and isinstance(ids[0], list)
        prompts = ids if batch else [ids]
        if not all(isinstance(t, int) for p in prompts for t in p):
            raise BadRequest("input_ids must be a list of ints or a list of such lists")
        return [list(p) for p in prompts], batch
    text = body.get("text")
    if text is None:
        raise BadRequest("need input_ids or text")
    batch = isinstance(text, list)
    texts = text if batch else [text]
    tok = state.engine.tokenizer
    return [tok.encode(t) for t in texts], batch


def _cut(c: Completion, stop: list[str], stop_ids: set[int], state: ServerState
         ) -> tuple[list[int], list[float], str, dict[str, Any]]:
    tokens, logprobs = c.tokens.tolist(), c.logprobs.tolist()
    reason: dict[str, Any] = (
        {"type": "stop", "matched": tokens[-1]} if c.finish_reason == "stop" and tokens
        else {"type": "abort", "message": "Abort request"} if c.finish_reason == "abort"
        else {"type": "length", "length": len(tokens)}
    )
    for i, t in enumerate(tokens):
        if t in stop_ids:
            tokens, logprobs = tokens[: i + 1], logprobs[: i + 1]
            reason = {"type": "stop", "matched": t}
            break
    tok = state.engine.tokenizer
    text = tok.decode(tokens, skip_special_tokens=True)
    for i in range(1, len(tokens) + 1) if stop else ():
        prefix = tok.decode(tokens[:i], skip_special_tokens=True)
        hit = next((s for s in stop if s in prefix), None)
        if hit is not None:
            tokens, logprobs = tokens[:i], logprobs[:i]
            text = prefix[: prefix.index(hit)]
            reason = {"type": "stop", "matched": hit}
            break
    return tokens, logprobs, text, reason


def _answer(prompt: list[int], c: Completion | None, rid: str, want_logprob: bool,
            stop: list[str], stop_ids: set[int], state: ServerState, started: float
            ) -> dict[str, Any]:
    ranges: list[dict[str, Any]] = []
    if c is None:
        tokens: list[int] = []
        logprobs: list[float] = []
        text = ""
        reason: dict[str, Any] = {"type": "abort", "message": "Abort request " + rid}
        version = state.weight_version
    else:
        tokens, logprobs, text, reason = _cut(c, stop, stop_ids, state)
        if reason["type"] == "abort":
            reason["message"] = "Abort request " + rid
        versions = c.token_versions()[: len(tokens)].tolist()
        for i, v in enumerate(versions):
            if ranges and ranges[-1]["_v"] == v:
                ranges[-1]["end"] = i + 1
            else:
                ranges.append({"_v": v, "version": state.labels.get(v, str(v)),
                               "start": i, "end": i + 1})
        last = versions[-1] if versions else c.weight_version
        version = state.labels.get(last, str(last))
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": reason,
        "prompt_tokens": len(prompt),
        "completion_tokens": len(tokens),
        "cached_tokens": 0,
        "weight_version": version,
        "e2e_latency": time.perf_counter() - started,
    }
    if len(ranges) > 1:  # the weights changed while this request ran
        meta["weight_versions"] = [{k: r[k] for k in ("version", "start", "end")}
                                   for r in ranges]
    if want_logprob:
        meta["input_token_logprobs"] = []
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in
                                         zip(logprobs, tokens, strict=True)]
    return {"text": text, "output_ids": tokens, "meta_info": meta}


async def generate(request: Request) -> Response:
    state: ServerState = request.app.state.server
    started = time.perf_counter()
    try:
        body = await request.json()
        if body.get("stream"):
            raise BadRequest("stream is not supported by serve-model")
        prompts, batch = _prompts(body, state)
        sampling, stop, stop_ids = _sampling(body.get("sampling_params") or {})
    except (BadRequest, ValueError, TypeError, AttributeError) as exc:
        return JSONResponse({"error": {"message": str(exc)}}, status_code=400)
    rid = body.get("rid")
    rid = rid if isinstance(rid, str) else uuid.uuid4().hex
    completions: list[Completion] | None = None
    error: Exception | None = None
    disconnected = False
    with trio.CancelScope() as scope:
        running = state.running[rid] = Running(scope)
        try:
            async with trio.open_nursery() as nursery:

                async def watch_disconnect() -> None:
                    nonlocal disconnected
                    while (await request.receive())["type"] != "http.disconnect":
                        pass
                    disconnected = True
                    scope.cancel()

                nursery.start_soon(watch_disconnect)
                state.waiting += 1
                try:
                    await state.resumed.wait()
                finally:
                    state.waiting -= 1
                running.in_engine = True
                try:
                    completions = await state.engine.generate(prompts, sampling,
                                                              abort=running.abort)
                except (ValueError, EngineClosed) as exc:
                    error = exc
                nursery.cancel_scope.cancel()
        finally:
            state.running.pop(rid, None)
    if error is not None:
        status = 400 if isinstance(error, ValueError) else 503
        return JSONResponse({"error": {"message": str(error)}}, status_code=status)
    if disconnected:
        log.info("request abandoned by client", rid=rid)
        return Response(status_code=499)
    state.aborted.discard(rid)
    want = bool(body.get("return_logprob"))
    answers = [
        _answer(p, None if completions is None else completions[i],
                rid if not batch else f"{rid}-{i}", want, stop, stop_ids, state, started)
        for i, p in enumerate(prompts)
    ]
    return JSONResponse(answers if batch else answers[0])


# ---------------------------------------------------------------------------- control


async def _body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw:
        return {}
    data = await request.json()
    if not isinstance(data, dict):
        raise BadRequest("body must be a JSON object")
    return data


def _abort(state: ServerState, rid: str | None = None) -> int:
    rids = list(state.running) if rid is None else [r for r in state.running if r == rid]
    for r in rids:
        state.running[r].stop()
    return len(rids)


async def abort_request(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await _body(request)
    n = _abort(state, None if body.get("abort_all") else str(body.get("rid")))
    log.info("aborted", requests=n)
    return Response(status_code=200)


async def health(request: Request) -> Response:
    return Response(status_code=200)


async def health_generate(request: Request) -> Response:
    state: ServerState = request.app.state.server
    with trio.move_on_after(20):
        await state.engine.generate([[int(state.engine.pad_id)]], Sampling(max_new_tokens=1))
        return Response(status_code=200)
    return Response(status_code=503)


async def model_info(request: Request) -> Response:
    state: ServerState = request.app.state.server
    config = state.engine.model.config
    return JSONResponse({
        "model_path": state.model_path,
        "tokenizer_path": state.model_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": state.weight_version,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": getattr(config, "model_type", None),
        "architectures": getattr(config, "architectures", None),
    })


async def server_info(request: Request) -> Response:
    state: ServerState = request.app.state.server
    stats = state.engine.statistics()
    return JSONResponse({
        "model_path": state.model_path,
        "tokenizer_path": state.model_path,
        "host": state.host,
        "port": state.port,
        "served_model_name": state.model_path,
        "device": "cpu",
        "dtype": str(state.engine.dtype).removeprefix("torch."),
        "dp_size": 1,
        "tp_size": 1,
        "max_running_requests": state.engine.max_batch,
        "weight_version": state.weight_version,
        "version": PROTOCOL_VERSION,
        "backend": "streamrl serve-model (transformers, CPU)",
        "internal_states": [{"batches": stats.batches, "rows": stats.rows,
                             "tokens": stats.tokens, "busy_s": stats.busy_s,
                             "weight_updates": dict(state.updates)}],
    })


async def loads(request: Request) -> Response:
    state: ServerState = request.app.state.server
    queued = state.engine.statistics().queued_rows
    running = max(0, len(state.running) - state.waiting)
    load = {"dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": state.waiting,
            "num_queued_rows": queued}
    return JSONResponse({
        "timestamp": time.time(), "version": PROTOCOL_VERSION, "dp_rank_count": 1,
        "loads": [load],
        "aggregate": {"total_running_reqs": running, "total_waiting_reqs": state.waiting},
    })


async def update_weights_from_disk(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await _body(request)
    path = body.get("model_path")
    if not isinstance(path, str):
        return JSONResponse({"success": False, "message": "model_path is required",
                             "num_paused_requests": 0}, status_code=400)
    if body.get("abort_all_requests"):
        _abort(state)
    started = time.perf_counter()
    version = state.engine.weight_version + 1
    label = body.get("weight_version")
    state.labels[version] = str(label) if label is not None else state.weight_version
    try:
        await state.engine.update_weights(path, version)
    except (OSError, ValueError, KeyError, EngineClosed) as exc:
        log.warning("weight update failed", path=path, error=str(exc))
        return JSONResponse({"success": False, "message": f"Failed to update weights: {exc}",
                             "num_paused_requests": 0}, status_code=400)
    state.weight_version = state.labels[version]
    state.model_path = path
    state.updates["disk"] += 1
    message = "Succeeded to update model weights."
    if label is not None:
        message += f" Weight version updated to {label}."
    log.info("weights updated", path=path, weight_version=state.weight_version,
             seconds=round(time.perf_counter() - started, 3))
    return JSONResponse({"success": True, "message": message, "num_paused_requests": 0})


async def update_weight_version(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await _body(request)
    state.weight_version = str(body["new_version"])
    state.labels[state.engine.weight_version] = state.weight_version
    return JSONResponse({"success": True, "message": f"Weight version updated to "
                         f"{state.weight_version}.", "new_version": state.weight_version})


async def pause_generation(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await _body(request)
    mode = body.get("mode", "abort")
    if mode not in ("abort", "retract", "in_place"):
        return JSONResponse({"error": {"message": f"unknown mode {mode!r}"}}, status_code=400)
    if state.resumed.is_set():
        state.resumed = trio.Event()
    if mode == "abort":
        _abort(state)
    return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(request: Request) -> Response:
    state: ServerState = request.app.state.server
    state.resumed.set()
    return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})


async def flush_cache(request: Request) -> Response:
    state: ServerState = request.app.state.server
    busy = bool(state.running)
    return Response(
        "Cache flushed.\nPlease check backend logs for more details. (When there are running "
        "or waiting requests, the operation will not be performed.)\n",
        status_code=400 if busy else 200,
    )


def _fail(message: str) -> Response:
    return JSONResponse({"success": False, "message": message}, status_code=400)


async def init_weights_update_group(request: Request) -> Response:
    """Join the learner's weight-update group as rank ``rank_offset`` (gloo only: CPU)."""
    from streamrl.inference.sglang_client import open_process_group

    state: ServerState = request.app.state.server
    body = await _body(request)
    if body.get("backend", "nccl") != "gloo":
        return _fail("serve-model runs on the CPU: backend must be 'gloo'")
    try:
        args = (str(body["master_address"]), int(body["master_port"]), int(body["rank_offset"]),
                int(body["world_size"]), str(body.get("group_name", "weight_update_group")))
    except (KeyError, TypeError, ValueError) as exc:
        return _fail(f"bad request: {exc!r}")
    try:
        group = await trio.to_thread.run_sync(partial(open_process_group, *args),
                                              abandon_on_cancel=True)
    except RuntimeError as exc:
        return _fail(f"Failed to initialize custom process group: {exc}")
    state.groups[args[4]] = group
    log.info("joined weight-update group", group=args[4], rank=args[2], world_size=args[3])
    return JSONResponse({"success": True,
                         "message": "Succeeded to initialize custom process group."})


async def update_weights_from_distributed(request: Request) -> Response:
    """Receive the named tensors from rank 0 of the group, then apply them between batches:
    all of the model's, or some (one bucket of a bucketed broadcast; the others keep their
    values, as in SGLang). (The tensors pass through a safetensors file in /dev/shm to reuse
    the engine's loader.)"""
    import torch
    from safetensors.torch import save_file

    from streamrl.inference.sglang_client import broadcast_tensor

    state: ServerState = request.app.state.server
    body = await _body(request)
    group = state.groups.get(str(body.get("group_name", "weight_update_group")))
    if group is None:
        return _fail("no such weight-update group: call /init_weights_update_group first")
    try:
        specs = [(str(n), getattr(torch, str(d).removeprefix("torch.")), [int(x) for x in s])
                 for n, d, s in zip(body["names"], body["dtypes"], body["shapes"], strict=True)]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        return _fail(f"bad request: {exc!r}")

    def receive() -> dict[str, torch.Tensor]:
        tensors = {}
        for name, dtype, shape in specs:
            tensors[name] = torch.empty(shape, dtype=dtype)
            broadcast_tensor(group, tensors[name])
        return tensors

    tensors = await trio.to_thread.run_sync(receive, abandon_on_cancel=True)
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    with tempfile.TemporaryDirectory(dir=shm) as tmp:
        file = Path(tmp) / "model.safetensors"
        await trio.to_thread.run_sync(save_file, tensors, str(file))
        version = state.engine.weight_version + 1
        label = body.get("weight_version")
        state.labels[version] = str(label) if label is not None else state.weight_version
        try:
            await state.engine.update_weights(file, version, partial=True)
        except (ValueError, KeyError, EngineClosed) as exc:
            return _fail(f"Failed to update parameter online: {exc}")
    state.weight_version = state.labels[version]
    state.updates["distributed"] += 1
    log.info("weights updated from the group", weight_version=state.weight_version,
             tensors=len(specs))
    return JSONResponse({"success": True, "message": "Succeeded to update parameter online."})


def build_app(state: ServerState) -> Starlette:
    routes = [
        Route("/generate", generate, methods=["POST", "PUT"]),
        Route("/abort_request", abort_request, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/health_generate", health_generate, methods=["GET"]),
        Route("/model_info", model_info, methods=["GET"]),
        Route("/get_model_info", model_info, methods=["GET"]),
        Route("/server_info", server_info, methods=["GET"]),
        Route("/get_server_info", server_info, methods=["GET"]),
        Route("/v1/loads", loads, methods=["GET"]),
        Route("/update_weights_from_disk", update_weights_from_disk, methods=["POST"]),
        Route("/update_weight_version", update_weight_version, methods=["POST"]),
        Route("/pause_generation", pause_generation, methods=["POST"]),
        Route("/continue_generation", continue_generation, methods=["POST"]),
        Route("/flush_cache", flush_cache, methods=["POST", "GET"]),
        Route("/init_weights_update_group", init_weights_update_group, methods=["POST"]),
        Route("/update_weights_from_distributed", update_weights_from_distributed,
              methods=["POST"]),
    ]
    app = Starlette(routes=routes)
    app.state.server = state
    return app


async def serve_model(
    model_dir: str | Path, *, host: str, port: int, max_batch: int = 32, threads: int = 1,
    weight_version: str = "default", openai_port: int = 0, openai_model: str = "streamrl-policy",
    dtype: str = "float32", task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Load the model, start the batcher and the HTTP server; run until cancelled. With
    ``openai_port`` the same engine also answers the OpenAI-compatible endpoint there
    (:mod:`inference.openai_api`: one base URL per episode, ``docs/agents.md``)."""
    from hypercorn.config import Config as HypercornConfig
    from hypercorn.trio import serve

    guard_connections()
    engine = await trio.to_thread.run_sync(partial(
        TransformersEngine, model_dir, max_batch=max_batch, threads=threads or None,
        batch_wait_s=BATCH_WAIT_S, dtype=dtype))
    state = ServerState(engine, str(model_dir), host, port, weight_version=weight_version)
    config = HypercornConfig()
    config.bind = [f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = None
    config.graceful_timeout = 1.0
    # Longer than any client's idle keep-alive (httpx: 5 s), so the client always closes an
    # idle connection first and never reuses one the server is closing.
    config.keep_alive_timeout = 75.0
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.serve_batches)
        await nursery.start(partial(serve, build_app(state), config,  # type: ignore[arg-type]
                                    shutdown_trigger=trio.sleep_forever))
        if openai_port:
            from streamrl.inference.agent_sessions import Sessions
            from streamrl.inference.openai_api import serve_openai

            await nursery.start(partial(serve_openai, Sessions.for_engine(engine),
                                        model=openai_model, host=host, port=openai_port))
        log.info("serving", host=host, port=port, model=str(model_dir),
                 weight_version=weight_version, dtype=str(engine.dtype).removeprefix("torch."))
        task_status.started()


def main_serve_model(model: str, host: str, port: int, max_batch: int, threads: int,
                     weight_version: str, openai_port: int = 0, dtype: str = "float32") -> int:
    """The ``streamrl serve-model`` command: serves until SIGINT (Ctrl-C, how ``streamrl up``
    stops it) or SIGTERM, then shuts down cleanly and exits 0."""
    from streamrl.models import UnknownModelSpec, resolve_model

    try:  # a mistyped --model: one line naming the valid specs, no traceback
        model_dir = resolve_model(model)
    except UnknownModelSpec as exc:
        raise SystemExit(f"streamrl serve-model: {exc}") from None
    trio.run(until_signalled, partial(
        serve_model, model_dir, host=host, port=port, max_batch=max_batch, threads=threads,
        weight_version=weight_version, openai_port=openai_port, dtype=dtype))
    return 0


async def until_signalled(serve: Callable[..., Awaitable[None]]) -> None:
    """Run ``serve`` (a ``task_status`` server) until SIGINT or SIGTERM, then cancel it."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve)
            async for signum in signals:
                log.info("stopping", signal=signal.Signals(signum).name)
                nursery.cancel_scope.cancel()
                break
    log.info("stopped")
