"""A client's malformed or hostile requests to the OpenAI-compatible endpoint (issue 32, item 4),
sent as raw HTTP (httpx) to the real endpoint in front of the real tiny transformers engine.

Each gets a 4xx with an OpenAI error body and a log line, reaches no engine, records nothing,
and leaves the session usable: the official ``openai`` client's next call is answered and
recorded. Tokenizing runs off the event loop: ``/health`` answers while a prompt is being
tokenized."""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import httpx
import openai
import pytest
import trio
from structlog.testing import capture_logs

from streamrl.inference.agent_sessions import Budget, Sessions
from streamrl.inference.openai_api import serve_openai
from streamrl.inference.transformers_engine import open_transformers_engine
from streamrl.models import resolve_model
from streamrl.net import free_port
from streamrl.protocol.messages import Sampling
from streamrl.testing.wait import wait_until

MODEL = "streamrl-policy"
MESSAGES = [{"role": "user", "content": "Say hi."}]
CHAT = "/sessions/s/v1/chat/completions"


@dataclass
class Served:
    url: str
    sessions: Sessions
    prompts: list[list[int]]  # every prompt that reached the engine


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.delenv(var, raising=False)
    yield


async def _serve(sessions: Sessions, nursery: trio.Nursery) -> str:
    port = free_port()
    await nursery.start(partial(serve_openai, sessions, model=MODEL, host="127.0.0.1",
                                port=port))
    return f"http://127.0.0.1:{port}"


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    """The endpoint over the tiny engine, with session ``s`` open."""
    async with open_transformers_engine(resolve_model("tiny")) as engine, \
            trio.open_nursery() as nursery:
        sessions = Sessions.for_engine(engine)
        prompts: list[list[int]] = []
        generate = sessions.generate

        async def recorded(batch: list[list[int]], sampling: Sampling, session: str) -> Any:
            prompts.extend(batch)
            return await generate(batch, sampling, session)

        sessions.generate = recorded
        sessions.create("s")
        yield Served(await _serve(sessions, nursery), sessions, prompts)
        nursery.cancel_scope.cancel()


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _deep_schema(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def _chat(**extra: Any) -> bytes:
    return json.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": 2, **extra}).encode()


BAD: dict[str, tuple[str, bytes]] = {
    "nested arrays in a chat body": (CHAT, f'{{"model": "{MODEL}", "messages": '
                                           f'{_nested(5000)}}}'.encode()),
    "nested arrays in a session's budget": ("/sessions", f'{{"id": "t", "budget": '
                                                         f'{_nested(5000)}}}'.encode()),
    "nested arrays as a tool call's arguments": ("/sessions/s/tools/read_file",
                                                 _nested(5000).encode()),
    "a tool schema nested 400 levels": (CHAT, _chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": _deep_schema(400)}}])),
    "a tool schema with a remote $ref": (CHAT, _chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {
            "a": {"$ref": "http://127.0.0.1:9/schema.json"}}}}}])),
    "a tool description that is not a string": (CHAT, _chat(tools=[{"type": "function",
                                                                     "function": {
        "name": "f", "description": 5}}])),
    "stream_options not an object": (CHAT, _chat(stream=True, stream_options="yes")),
    "stream not a boolean": (CHAT, _chat(stream="yes")),
    "a lone surrogate in a message": (CHAT, _chat(messages=[{"role": "user",
                                                             "content": "a\ud800b"}])),
    "a session id that is not URL-safe": ("/sessions", b'{"id": "a b?c"}'),
    "an empty chat body": (CHAT, b""),
    "a chat body without a model": (CHAT, json.dumps({"messages": MESSAGES}).encode()),
}


def _ask(base_url: str) -> Any:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)  # type: ignore[arg-type]


@pytest.mark.parametrize("case", list(BAD))
async def test_a_malformed_request_gets_a_4xx_a_log_line_and_leaves_the_session_usable(
        served: Served, case: str) -> None:
    path, body = BAD[case]
    # When the client sends it
    with capture_logs() as logs:
        async with httpx.AsyncClient(base_url=served.url, timeout=60) as http:
            r = await http.post(path, content=body, headers={"Content-Type": "application/json"})
    # Then it is a 400 with an OpenAI error body, and the server's log says so
    assert r.status_code == 400, (r.status_code, r.text[:300])
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert any(e.get("status") == r.status_code and e.get("code") == error["code"]
               for e in logs), logs
    # and nothing reached the engine or was recorded
    assert served.prompts == [] and served.sessions.get("s").calls == []
    assert [s for s in ("t", "a b?c") if s in served.sessions._sessions] == []
    # and the session still answers the official client, which is recorded once
    answer = await trio.to_thread.run_sync(_ask, f"{served.url}/sessions/s/v1")
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert len(served.sessions.get("s").calls) == 1


async def test_the_official_client_gets_400_for_a_deep_tool_schema_and_does_not_retry(
        served: Served) -> None:
    requests: list[str] = []
    http = httpx.Client(event_hooks={"request": [lambda r: requests.append(str(r.url))]})

    def agent() -> openai.APIStatusError:
        client = openai.OpenAI(base_url=f"{served.url}/sessions/s/v1", api_key="unused",
                               http_client=http)  # the client's own retries (2)
        with pytest.raises(openai.APIStatusError) as info:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[  # type: ignore[arg-type,list-item]
                {"type": "function", "function": {"name": "f", "parameters": _deep_schema(400)}}])
        return info.value

    error = await trio.to_thread.run_sync(agent)
    http.close()
    assert error.status_code == 400 and len(requests) == 1


async def test_context_overflow_names_the_models_context_and_budgets_their_own(
        served: Served) -> None:
    long = [{"role": "user", "content": "word " * 3000}]  # past the tiny model's 2048
    served.sessions.create("b", Budget(max_total_tokens=20))
    async with httpx.AsyncClient(base_url=served.url, timeout=60) as http:
        over = await http.post(CHAT, content=_chat(messages=long))
        spent = await http.post("/sessions/b/v1/chat/completions",
                                content=_chat(messages=[{"role": "user", "content": "hi " * 30}]))
    error = over.json()["error"]
    assert (over.status_code, error["code"], error["type"]) == (
        400, "context_length_exceeded", "invalid_request_error")
    assert "2048" in error["message"] and "unlimited" not in error["message"], error
    error = spent.json()["error"]
    assert (spent.status_code, error["code"], error["type"]) == (
        400, "max_total_tokens_exceeded", "budget_exceeded")
    assert "20 tokens" in error["message"], error


class GatedTokenizer:
    """The real tokenizer, whose encoding waits for ``release`` once ``entered`` is set: lets a
    test act while a prompt is being tokenized."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.entered, self.release = threading.Event(), threading.Event()
        self.held_until_released: bool | None = None  # False: the wait ran out instead

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def __call__(self, text: str, **kwargs: Any) -> Any:
        if len(text) > 100_000:
            self.entered.set()
            self.held_until_released = self.release.wait(timeout=20)
        return self._tokenizer(text, **kwargs)


async def test_health_and_other_sessions_answer_while_a_large_prompt_is_tokenized() -> None:
    async with open_transformers_engine(resolve_model("tiny")) as engine, \
            trio.open_nursery() as nursery:
        gated = GatedTokenizer(engine.tokenizer)
        sessions = Sessions.for_engine(engine, gated)
        sessions.create("big")
        url = await _serve(sessions, nursery)
        big = _chat(messages=[{"role": "user", "content": "word " * 200_000}])
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            answers: list[httpx.Response] = []

            async def send_big() -> None:
                answers.append(await http.post("/sessions/big/v1/chat/completions",
                                               content=big))

            nursery.start_soon(send_big)
            # Given the big prompt is being tokenized
            await trio.to_thread.run_sync(partial(gated.entered.wait, 30))
            assert gated.entered.is_set()
            # When /health and a new session are asked for, Then they answer meanwhile
            health = await http.get("/health")
            created = await http.post("/sessions", json={"id": "other"})
            gated.release.set()
            await wait_until(lambda: answers, timeout=30)
        # (on the event loop, the gate would have held everything until its wait ran out)
        assert (health.status_code, created.status_code) == (200, 201)
        assert gated.held_until_released is True
        assert answers[0].json()["error"]["code"] == "context_length_exceeded"
        nursery.cancel_scope.cancel()


async def test_an_error_of_ours_is_a_logged_500_with_a_body_and_records_nothing(
        served: Served) -> None:
    # Given an engine call that fails once with an error that is no engine failure (a bug)
    generate = served.sessions.generate
    failures = [KeyError("a bug of ours")]

    async def failing_once(batch: list[list[int]], sampling: Sampling, session: str) -> Any:
        if failures:
            raise failures.pop()
        return await generate(batch, sampling, session)

    served.sessions.generate = failing_once
    # When the client asks
    with capture_logs() as logs:
        async with httpx.AsyncClient(base_url=served.url, timeout=60) as http:
            r = await http.post(CHAT, content=_chat())
    # Then it is a 500 with an OpenAI error body, the traceback is in the log, nothing recorded
    assert r.status_code == 500, r.text[:300]
    assert r.json()["error"]["type"] == "server_error"
    assert any(e.get("status") == 500 and e.get("exc_info") for e in logs), logs
    assert served.sessions.get("s").calls == []
    # and the session answers the next call
    answer = await trio.to_thread.run_sync(_ask, f"{served.url}/sessions/s/v1")
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert len(served.sessions.get("s").calls) == 1
