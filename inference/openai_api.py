"""An OpenAI-compatible endpoint in front of an inference engine, one base URL per episode.

An agent written against the official ``openai`` client is pointed at
``http://HOST:PORT/sessions/<episode>/v1`` and trained unchanged: every call it makes is
recorded into the episode's session (:mod:`inference.agent_sessions`) as the exact prompt
and completion token ids, logprobs and weight versions of the engine.

Guarantees:
- ``POST /sessions/<id>/v1/chat/completions`` takes ``model``, ``messages``, ``tools``,
  ``tool_choice`` (``auto``, ``none``), ``temperature``, ``top_p``, ``max_tokens`` /
  ``max_completion_tokens``, ``n`` (1), ``stop``, ``seed``, ``logprobs``, ``stream`` (the
  whole answer as SSE chunks once generated) and answers OpenAI's shapes:
  ``choices[0].message`` with ``content`` and ``tool_calls`` (``id``, ``function.name``,
  ``function.arguments`` as a JSON string), ``finish_reason`` ``tool_calls`` / ``stop`` /
  ``length``, ``usage``; ``system_fingerprint`` names the weight version of the first token;
  ``GET /v1/models`` (also under a session) lists the one served model;
- every refusal is an OpenAI error body ``{"error": {message, type, param, code}}`` and one
  log line (``request refused``): 404 for an unknown session or model, 400 for a malformed
  or unsupported request (a body that is not a JSON object, nested deeper than
  :data:`MAX_DEPTH`, or holding a string that is not UTF-8 text: a lone surrogate; a
  parameter of the wrong type; no ``model``) and for a spent budget (``type``
  ``budget_exceeded``; 400 because the official client retries 429s), 503 only when the
  engine is gone. Nothing a client sends raises out of a handler: an error of ours is a 500
  with the same body and a logged traceback;
- a request is checked whole before it reaches the engine, and a call is recorded only once
  its answer is built (:meth:`Sessions.complete`'s ``accept``): a call that fails is not in
  the episode. Bodies are parsed and prompts tokenized in a worker thread, so one large
  prompt does not hold up ``/health`` or the other sessions;
- the session API for the executor: ``POST /sessions`` ``{"id", "budget": {max_total_tokens,
  max_calls, wall_clock_s, max_new_tokens}}`` (201, answers the ``base_url``; an ``id`` is
  1 to 128 URL-safe characters: letters, digits, ``. _ ~ -``), ``GET
  /sessions/<id>`` and ``POST /sessions/<id>/close`` (the record: ``calls`` and ``chains``,
  see :meth:`Session.chains`), ``DELETE /sessions/<id>``;
- a session with a tool set (the episode's sandbox, set by the executor that runs the
  agent: actors/agents.py) serves it next to the model: ``GET /sessions/<id>/tools`` (the
  tools in OpenAI's ``{"type": "function", "function": ...}`` form, ready for ``tools=``)
  and ``POST /sessions/<id>/tools/<name>`` with the arguments as the JSON body, answering
  ``{"content", "error"}`` (a refused call is ``error: true``, status 200: what the agent
  sends back to the model); counted against ``budget.max_tool_calls`` and the wall clock.

Not supported (400): ``n`` > 1, ``tool_choice`` ``required`` or a named function,
``top_logprobs``, penalties, ``logit_bias``, ``response_format`` other than text, non-text
content parts. With ``tool_choice`` ``none`` the tools are still shown to the model (the
prompt stays a prefix of the next call's) but its reply is not parsed for calls.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial, wraps
from typing import Any

import msgspec
import structlog
import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from streamrl.inference.agent_sessions import Budget, Call, Session, Sessions
from streamrl.inference.chat import tool_format
from streamrl.inference.http import guard_connections
from streamrl.inference.openai_chat import (
    InvalidRequest,
    Message,
    parse_messages,
    parse_reply,
    parse_tools,
)
from streamrl.protocol.messages import MAX_NEW_TOKENS, Sampling

log = structlog.get_logger()
MAX_BODY = 32 << 20
MAX_DEPTH = 64  # nesting of a body's arrays and objects (a tool schema's included)
UNSUPPORTED_ZERO = ("presence_penalty", "frequency_penalty", "top_logprobs")
Handler = Callable[["Endpoint", Request], Awaitable[Response]]


def answering(handler: Handler) -> Handler:
    """``handler`` answering every refusal (:class:`InvalidRequest`) as its OpenAI error and
    any other exception as a 500 with the same body, each with a log line."""

    @wraps(handler)
    async def answer(self: Endpoint, request: Request) -> Response:
        try:
            return await handler(self, request)
        except InvalidRequest as exc:
            level = log.warning if exc.status >= 500 else log.info
            level("request refused", path=request.url.path, status=exc.status, code=exc.code,
                  message=str(exc)[:300])
            return JSONResponse(exc.body(), status_code=exc.status)
        except Exception:
            log.exception("request failed", path=request.url.path, status=500)
            error = InvalidRequest("internal error (logged by the server)",
                                   code="internal_error", status=500, kind="server_error")
            return JSONResponse(error.body(), status_code=500)

    return answer


async def _json(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if len(raw) > MAX_BODY:
        raise InvalidRequest(f"body over {MAX_BODY} bytes", code="body_too_large", status=413)
    return await trio.to_thread.run_sync(parse_body, raw)


def parse_body(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object (empty: ``{}``) whose values nest at most
    :data:`MAX_DEPTH` deep and whose strings are UTF-8 text; else :class:`InvalidRequest`."""
    try:
        data = json.loads(raw) if raw else {}
    except RecursionError:
        raise InvalidRequest(f"body nested deeper than {MAX_DEPTH} levels",
                             code="invalid_json") from None
    except ValueError as exc:
        raise InvalidRequest(f"body is not JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise InvalidRequest("body must be a JSON object", code="invalid_json")
    problem = _value_problem(data)
    if problem:
        raise InvalidRequest(problem, code="invalid_json")
    return data


def _value_problem(data: Any) -> str:
    """What makes a parsed body unusable (too deep, a string that is not text), or ``""``."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            try:
                value.encode()
            except UnicodeEncodeError as exc:
                return f"a string holds a lone surrogate ({value[exc.start]!r}): send UTF-8 text"
        elif isinstance(value, dict | list) and depth > MAX_DEPTH:
            return f"body nested deeper than {MAX_DEPTH} levels"
        elif isinstance(value, dict):
            stack += [(k, depth) for k in value] + [(v, depth + 1) for v in value.values()]
        elif isinstance(value, list):
            stack += [(v, depth + 1) for v in value]
    return ""


def _messages_and_tools(body: dict[str, Any]) -> tuple[list[Message], list[dict[str, Any]]]:
    """The request's messages and its tools, their schemas checked (in a worker thread)."""
    return parse_messages(body.get("messages")), parse_tools(body.get("tools"))


def _unsupported(param: str, why: str) -> InvalidRequest:
    return InvalidRequest(f"{param}: {why}", code="unsupported_parameter", param=param)


def _flag(body: dict[str, Any], name: str, where: Any = None) -> bool:
    value = (body if where is None else where).get(name)
    if value is not None and not isinstance(value, bool):
        raise InvalidRequest(f"{name} must be a boolean", param=name)
    return bool(value)


@dataclass(frozen=True)
class Answering:
    """How a chat call is answered: as SSE chunks (``stream``, with a usage chunk), with
    logprobs."""

    stream: bool
    include_usage: bool
    logprobs: bool

    @classmethod
    def of(cls, body: dict[str, Any]) -> Answering:
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise InvalidRequest("stream_options must be an object", param="stream_options")
        return cls(_flag(body, "stream"), _flag(body, "include_usage", options or {}),
                   _flag(body, "logprobs"))


def _sampling(body: dict[str, Any]) -> tuple[Sampling, list[str]]:
    if body.get("n", 1) not in (1, None):
        raise _unsupported("n", "only n = 1")
    for name in UNSUPPORTED_ZERO:
        if body.get(name):
            raise _unsupported(name, "not supported")
    if body.get("logit_bias"):
        raise _unsupported("logit_bias", "not supported")
    fmt = body.get("response_format")
    if fmt and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise _unsupported("response_format", "only text")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise InvalidRequest("stop must be a string or a list of strings", param="stop")
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    params = {"max_new_tokens": MAX_NEW_TOKENS if limit is None else limit,
              "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
              "seed": body.get("seed")}
    try:
        sampling = msgspec.convert({k: v for k, v in params.items() if v is not None}, Sampling)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"bad sampling parameters: {exc}", code="invalid_sampling") from None
    return sampling, stop


class Endpoint:
    """The Starlette handlers over one :class:`Sessions` and one served model name."""

    def __init__(self, sessions: Sessions, model: str) -> None:
        self.sessions = sessions
        self.model_name = model
        self.fmt = tool_format(sessions.tokenizer)  # how the model writes its calls

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "streamrl"}

    @answering
    async def models(self, request: Request) -> Response:
        sid = request.path_params.get("sid")
        if sid is not None:
            self.sessions.get(sid)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    @answering
    async def model(self, request: Request) -> Response:
        if request.path_params["model"] != self.model_name:
            raise InvalidRequest(f"no model {request.path_params['model']!r}",
                                 code="model_not_found", status=404)
        return JSONResponse(self._model_card())

    @answering
    async def no_session(self, request: Request) -> Response:
        raise InvalidRequest("use the episode's base URL: /sessions/<episode>/v1",
                             code="session_required", status=404)

    @answering
    async def chat(self, request: Request) -> Response:
        session = self.sessions.get(request.path_params["sid"])
        body = await _json(request)
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise InvalidRequest("model is required (a string)", param="model")
        if model != self.model_name:
            raise InvalidRequest(f"no model {model!r}; this endpoint serves {self.model_name!r}",
                                 code="model_not_found", param="model", status=404)
        messages, tools = await trio.to_thread.run_sync(_messages_and_tools, body)
        choice = body.get("tool_choice", "auto") or "auto"
        if choice not in ("auto", "none"):
            raise _unsupported("tool_choice", "only 'auto' and 'none'")
        sampling, stop = _sampling(body)
        how = Answering.of(body)
        parse = partial(parse_reply, tools=tools if choice == "auto" else [], fmt=self.fmt)
        answers: list[Response] = []
        await self.sessions.complete(session, messages, tools, sampling, stop, parse,
                                     accept=lambda call: answers.append(self._response(call, how)))
        return answers[0]

    def _response(self, call: Call, how: Answering) -> Response:
        answer = self._answer(call, how.logprobs)
        if how.stream:
            return Response(_sse(answer, how.include_usage), media_type="text/event-stream")
        return JSONResponse(answer)

    def _answer(self, call: Call, logprobs: bool) -> dict[str, Any]:
        reply = call.reply
        message: dict[str, Any] = {"role": "assistant",
                                   "content": reply.content or (None if reply.tool_calls else "")}
        if reply.tool_calls:
            message["tool_calls"] = [c.openai() for c in reply.tool_calls]
        reason = "tool_calls" if reply.tool_calls else call.finish_reason
        choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None,
                                  "finish_reason": reason}
        if logprobs:
            tok = self.sessions.tokenizer
            choice["logprobs"] = {"content": [
                {"token": tok.decode([t]), "logprob": lp, "bytes": list(tok.decode([t]).encode()),
                 "top_logprobs": []} for t, lp in zip(call.completion_ids, call.logprobs,
                                                      strict=True)]}
        n_prompt, n_out = len(call.prompt_ids), len(call.completion_ids)
        version = call.versions[0] if call.versions else 0
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                "created": int(time.time()), "model": self.model_name,
                "system_fingerprint": f"streamrl-v{version}", "choices": [choice],
                "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out,
                          "total_tokens": n_prompt + n_out}}

    # ------------------------------------------------------------------ the session API

    def _record(self, session: Session) -> dict[str, Any]:
        return {**session.summary(), "calls": [c.to_builtins() for c in session.calls],
                "chains": [c.to_builtins() for c in session.chains()]}

    @answering
    async def create(self, request: Request) -> Response:
        body = await _json(request)
        sid = body.get("id") or uuid.uuid4().hex
        if not isinstance(sid, str):
            raise InvalidRequest("id must be a string", param="id")
        try:
            budget = msgspec.convert(body.get("budget") or {}, Budget)
        except msgspec.ValidationError as exc:
            raise InvalidRequest(f"bad budget: {exc}", param="budget") from None
        session = self.sessions.create(sid, budget)
        base = str(request.base_url).rstrip("/")
        return JSONResponse({**session.summary(), "base_url": f"{base}/sessions/{sid}/v1"},
                            status_code=201)

    @answering
    async def show(self, request: Request) -> Response:
        return JSONResponse(self._record(self.sessions.get(request.path_params["sid"])))

    @answering
    async def close(self, request: Request) -> Response:
        return JSONResponse(self._record(self.sessions.close(request.path_params["sid"])))

    @answering
    async def drop(self, request: Request) -> Response:
        return JSONResponse(self.sessions.drop(request.path_params["sid"]).summary())

    @answering
    async def tool_specs(self, request: Request) -> Response:
        session = self.sessions.get(request.path_params["sid"])
        if session.tools is None:
            raise InvalidRequest(f"session {session.id!r} has no tools", code="no_tools",
                                 status=404)
        return JSONResponse({"object": "list", "data": session.tools.specs()})

    @answering
    async def tool_call(self, request: Request) -> Response:
        session = self.sessions.get(request.path_params["sid"])
        arguments = await _json(request)
        return JSONResponse(await session.call_tool(request.path_params["name"], arguments))

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)


def _sse(answer: dict[str, Any], include_usage: bool) -> str:
    """The answer as chat.completion.chunk events (one content delta, one per tool call)."""
    head = {k: answer[k] for k in ("id", "created", "model", "system_fingerprint")}
    choice, message = answer["choices"][0], answer["choices"][0]["message"]
    deltas: list[dict[str, Any]] = [{"role": "assistant", "content": message["content"] or ""}]
    deltas += [{"tool_calls": [{"index": j, **call}]}
               for j, call in enumerate(message.get("tool_calls", []))]
    chunks = [{**head, "object": "chat.completion.chunk",
               "choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
    last = {"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}
    chunks.append({**head, "object": "chat.completion.chunk", "choices": [last]})
    if include_usage:
        chunks.append({**head, "object": "chat.completion.chunk", "choices": [],
                       "usage": answer["usage"]})
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


def build_app(sessions: Sessions, model: str) -> Starlette:
    e = Endpoint(sessions, model)
    routes = [
        Route("/health", e.health, methods=["GET"]),
        Route("/v1/models", e.models, methods=["GET"]),
        Route("/v1/models/{model:path}", e.model, methods=["GET"]),
        Route("/v1/chat/completions", e.no_session, methods=["POST"]),
        Route("/sessions", e.create, methods=["POST"]),
        Route("/sessions/{sid}", e.show, methods=["GET"]),
        Route("/sessions/{sid}", e.drop, methods=["DELETE"]),
        Route("/sessions/{sid}/close", e.close, methods=["POST"]),
        Route("/sessions/{sid}/v1/models", e.models, methods=["GET"]),
        Route("/sessions/{sid}/v1/models/{model:path}", e.model, methods=["GET"]),
        Route("/sessions/{sid}/v1/chat/completions", e.chat, methods=["POST"]),
        Route("/sessions/{sid}/tools", e.tool_specs, methods=["GET"]),
        Route("/sessions/{sid}/tools/{name}", e.tool_call, methods=["POST"]),
    ]
    app = Starlette(routes=routes)
    app.state.endpoint = e
    return app


async def serve_openai(sessions: Sessions, *, model: str, host: str, port: int,
                       task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve the endpoint on ``host:port`` until cancelled (``started()`` once bound)."""
    from hypercorn.config import Config as HypercornConfig
    from hypercorn.trio import serve

    guard_connections()
    config = HypercornConfig()
    config.bind = [f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = None
    config.graceful_timeout = 1.0
    config.keep_alive_timeout = 75.0
    await trio.lowlevel.checkpoint()
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(serve, build_app(sessions, model), config,  # type: ignore[arg-type]
                                    shutdown_trigger=trio.sleep_forever))
        log.info("serving the OpenAI endpoint", host=host, port=port, model=model)
        task_status.started()
