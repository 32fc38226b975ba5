"""The OpenAI-compatible endpoint against the official ``openai`` client, on a loopback port, in
front of the real transformers engine (the tiny model, trained for a few seconds to answer a
scripted agent with a tool call, then with a final message)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
import trio

from streamrl.inference.agent_sessions import Sessions
from streamrl.inference.engine import Completion
from streamrl.inference.openai_api import serve_openai
from streamrl.inference.openai_chat import encode, parse_messages, parse_reply, parse_tools
from streamrl.inference.transformers_engine import TransformersEngine, open_transformers_engine
from streamrl.models import load_model, load_tokenizer, resolve_model
from streamrl.net import free_port
from streamrl.protocol.messages import Sampling

MODEL = "streamrl-policy"
TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the repository",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}]
MESSAGES = [{"role": "system", "content": "You fix bugs."},
            {"role": "user", "content": "Fix the bug in a.py"}]
CALL_TEXT = '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>'
RESULT = "def f():\n    return 1"
FINAL = "Fixed."


def _scripted(tokens: list[int]) -> Any:
    async def generate(prompts: list[list[int]], sampling: Sampling, session: str
                       ) -> list[Completion]:
        return [Completion(np.asarray(tokens, np.int32), np.zeros(len(tokens), np.float32),
                           CALL_TEXT, "stop", 0)]
    return generate


async def _training_sequence(tokenizer: Any, im_end: int) -> tuple[list[int], list[int]]:
    """The conversation the agent will have, as the endpoint renders it: (ids, positions of
    the model's tokens)."""
    reply = [*encode(tokenizer, CALL_TEXT), im_end]
    sessions = Sessions(_scripted(reply), tokenizer, {im_end})
    session = sessions.create("train")
    messages, tools = parse_messages(MESSAGES), parse_tools(TOOLS)
    first = await sessions.complete(session, messages, tools, Sampling(), [],
                                    partial(parse_reply, tools=parse_tools(TOOLS)))
    calls = [c.openai() for c in first.reply.tool_calls]
    second = parse_messages([*MESSAGES, {"role": "assistant", "tool_calls": calls},
                             {"role": "tool", "tool_call_id": calls[0]["id"], "content": RESULT}])
    prompt, _, _ = sessions.prompt(session, second, tools)
    final = [*encode(tokenizer, FINAL), im_end]
    n1 = len(first.prompt_ids)
    model_positions = [*range(n1, n1 + len(reply)), *range(len(prompt), len(prompt) + len(final))]
    return prompt + final, model_positions


@pytest.fixture(scope="module")
def agent_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model overfit (greedy) on the scripted conversation's model tokens."""
    tiny = resolve_model("tiny")
    tokenizer = load_tokenizer(tiny)
    im_end = int(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    seq, positions = trio.run(_training_sequence, tokenizer, im_end)
    model = load_model(tiny).train()
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ids, at = torch.tensor([seq]), torch.tensor([p - 1 for p in positions])
    target = torch.tensor([seq[p] for p in positions])
    for _ in range(400):
        hidden = model.model(input_ids=ids).last_hidden_state[0, at]
        loss = torch.nn.functional.cross_entropy(model.lm_head(hidden), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.005:
            break
    out = tmp_path_factory.mktemp("agent-model")
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


@dataclass
class Served:
    url: str
    engine: TransformersEngine
    sessions: Sessions
    seen: list[tuple[list[int], Completion]]  # every generation: (prompt, engine's answer)

    async def create(self, sid: str, **budget: Any) -> str:
        async with httpx.AsyncClient() as http:
            r = await http.post(f"{self.url}/sessions", json={"id": sid, "budget": budget})
        assert r.status_code == 201, r.text
        return str(r.json()["base_url"])

    def client(self, base_url: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
async def served(agent_model: Path) -> AsyncIterator[Served]:
    async with open_transformers_engine(agent_model) as engine:
        sessions = Sessions.for_engine(engine)
        seen: list[tuple[list[int], Completion]] = []
        generate = sessions.generate

        async def recorded(prompts: list[list[int]], sampling: Sampling, session: str
                           ) -> list[Completion]:
            out = await generate(prompts, sampling, session)
            seen.extend(zip(prompts, out, strict=True))
            return out

        sessions.generate = recorded
        port = free_port()
        async with trio.open_nursery() as nursery:
            await nursery.start(partial(serve_openai, sessions, model=MODEL, host="127.0.0.1",
                                        port=port))
            yield Served(f"http://127.0.0.1:{port}", engine, sessions, seen)
            nursery.cancel_scope.cancel()


def _agent(served: Served, base_url: str, update_weights: Any) -> list[Any]:
    """A scripted agent with the official client: list models, ask, run the tool it asked
    for, send the result back, get the final answer."""
    client = served.client(base_url)
    [model] = [m.id for m in client.models.list()]
    messages: list[Any] = list(MESSAGES)
    first = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                           temperature=0, max_tokens=64)
    message = first.choices[0].message
    messages.append(message)
    for call in message.tool_calls or []:
        assert json.loads(call.function.arguments) == {"path": "a.py"}
        messages.append({"role": "tool", "tool_call_id": call.id, "content": RESULT})
    update_weights()  # the learner publishes version 1 between the agent's two calls
    second = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                            temperature=0, max_tokens=64)
    return [first, second]


async def test_agent_turns_are_recorded_as_the_engine_produced_them(
        served: Served, agent_model: Path) -> None:
    # Given a session for episode ep-1 and an agent using the official openai client
    base_url = await served.create("ep-1")
    update = partial(trio.from_thread.run, served.engine.update_weights, agent_model, 1)
    # When the agent calls a tool, gets its result and answers
    first, second = await trio.to_thread.run_sync(_agent, served, base_url, update)
    # Then the answers have OpenAI's shapes
    call = first.choices[0].message.tool_calls[0]
    assert (call.type, call.function.name, first.choices[0].finish_reason) == (
        "function", "read_file", "tool_calls")
    assert call.id.startswith("call_") and first.choices[0].message.content is None
    assert second.choices[0].message.content == FINAL
    assert (second.choices[0].finish_reason, second.choices[0].message.tool_calls) == ("stop", None)
    assert first.system_fingerprint == "streamrl-v0" and second.system_fingerprint == "streamrl-v1"
    async with httpx.AsyncClient() as http:
        record = (await http.post(f"{served.url}/sessions/ep-1/close")).json()
    calls = record["calls"]
    assert len(calls) == len(served.seen) == 2
    # and every call's prompt, tokens, logprobs and versions are the engine's own
    for c, (prompt, completion), answer in zip(calls, served.seen, [first, second], strict=True):
        assert c["prompt_ids"] == prompt
        assert c["completion_ids"] == completion.tokens.tolist()
        assert c["logprobs"] == completion.logprobs.tolist()
        assert c["versions"] == completion.token_versions().tolist()
        assert answer.usage.prompt_tokens == len(prompt)
        assert answer.usage.completion_tokens == len(completion.tokens)
    assert set(calls[0]["versions"]) == {0} and set(calls[1]["versions"]) == {1}
    # and the second prompt is the first prompt + the engine's completion, never re-tokenized
    head = calls[0]["prompt_ids"] + calls[0]["completion_ids"]
    assert calls[1]["parent"] == 0 and calls[1]["new_from"] == len(head)
    assert calls[1]["prompt_ids"][: len(head)] == head
    # and the episode's one chain masks in exactly the model's tokens
    [chain] = record["chains"]
    tokens, mask = chain["tokens"], chain["mask"]
    assert chain["prompt_ids"] == calls[0]["prompt_ids"]
    assert tokens == calls[0]["completion_ids"] + calls[1]["prompt_ids"][len(head):] + calls[1][
        "completion_ids"]
    assert [t for t, m in zip(tokens, mask, strict=True) if m] == (
        calls[0]["completion_ids"] + calls[1]["completion_ids"])
    assert all(lp == 0.0 for lp, m in zip(chain["logprobs"], mask, strict=True) if not m)
    sample = served.sessions.get("ep-1").chains()[0].sample(FINAL, "stop")
    assert np.frombuffer(sample.mask, np.uint8).tolist() == mask and sample.weight_version == 0


async def test_a_rewritten_history_starts_a_new_chain(served: Served) -> None:
    base_url = await served.create("ep-2")

    def agent() -> None:
        client = served.client(base_url)
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
        edited = [MESSAGES[0], {"role": "user", "content": "Something else"}]
        client.chat.completions.create(model=MODEL, messages=edited, max_tokens=4)

    await trio.to_thread.run_sync(agent)
    async with httpx.AsyncClient() as http:
        record = (await http.get(f"{served.url}/sessions/ep-2")).json()
    assert [c["parent"] for c in record["calls"]] == [-1, -1]
    assert [ch["calls"] for ch in record["chains"]] == [[0], [1]]


async def test_streaming_answers_the_same_call(served: Served) -> None:
    base_url = await served.create("ep-3")

    def agent() -> list[Any]:
        stream = served.client(base_url).chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=64,
            stream=True, stream_options={"include_usage": True})
        return list(stream)

    chunks = await trio.to_thread.run_sync(agent)
    calls = [tc for ch in chunks for choice in ch.choices for tc in choice.delta.tool_calls or []]
    assert [c.function.name for c in calls] == ["read_file"]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
    assert chunks[-1].usage.completion_tokens == len(served.seen[-1][1].tokens)


def _refusal(fn: Any) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as info:
        fn()
    return info.value


def _code(error: openai.APIStatusError) -> str:
    body = error.body
    assert isinstance(body, dict), body
    return str(body["code"])


async def test_budgets_refuse_with_openai_errors(served: Served) -> None:
    # Given sessions with one call, a few tokens, and a short wall clock
    calls_url = await served.create("calls", max_calls=1)
    prompt_len = len(served.sessions.prompt(served.sessions.get("calls"),
                                            parse_messages(MESSAGES), [])[0])
    tokens_url = await served.create("tokens", max_total_tokens=prompt_len + 3)
    clock_url = await served.create("clock", wall_clock_s=0.5)

    def agent() -> list[tuple[int, str]]:
        out = []
        ask = partial(dict, model=MODEL, messages=MESSAGES, max_tokens=32)
        c = served.client(calls_url)
        c.chat.completions.create(**ask())
        e = _refusal(lambda: c.chat.completions.create(**ask()))
        out.append((e.status_code, _code(e)))
        t = served.client(tokens_url)
        first = t.chat.completions.create(**ask())
        out.append((first.usage.completion_tokens, first.choices[0].finish_reason))
        e = _refusal(lambda: t.chat.completions.create(**ask()))
        out.append((e.status_code, _code(e)))
        w = served.client(clock_url)
        import time
        time.sleep(0.6)
        e = _refusal(lambda: w.chat.completions.create(**ask()))
        out.append((e.status_code, _code(e)))
        return out

    # When each goes past its budget, Then it is refused with a clear OpenAI error
    assert await trio.to_thread.run_sync(agent) == [
        (400, "max_calls_exceeded"), (3, "length"), (400, "max_total_tokens_exceeded"),
        (400, "wall_clock_exceeded")]
    assert [len(served.sessions.get(s).calls) for s in ("calls", "tokens", "clock")] == [1, 1, 0]


async def test_bad_requests_get_4xx_and_the_server_lives_on(served: Served) -> None:
    base_url = await served.create("bad")

    def agent() -> list[tuple[int, str]]:
        c = served.client(base_url)
        ask = partial(dict, model=MODEL, messages=MESSAGES, max_tokens=4)
        attempts = [
            lambda: served.client(f"{served.url}/sessions/nope/v1").chat.completions.create(
                **ask()),
            lambda: c.chat.completions.create(**{**ask(), "model": "gpt-4o"}),
            lambda: c.chat.completions.create(**{**ask(), "messages": [{"role": "wizard",
                                                                         "content": "x"}]}),
            lambda: c.chat.completions.create(**{**ask(), "messages": [{"role": "user",
                                                                         "content": 7}]}),
            lambda: c.chat.completions.create(**{**ask(), "messages": []}),
            lambda: c.chat.completions.create(**ask(), tools=[{"type": "function"}]),
            lambda: c.chat.completions.create(**ask(), n=2),
            lambda: c.chat.completions.create(**ask(), tool_choice="required", tools=TOOLS),
            lambda: c.chat.completions.create(**ask(), temperature=-1),
            lambda: c.chat.completions.create(**{**ask(), "messages": [
                {"role": "user", "content": "many words " * 2000}]}),
            lambda: served.client(f"{served.url}/v1").chat.completions.create(**ask()),
        ]
        return [(e.status_code, _code(e)) for e in map(_refusal, attempts)]

    codes = await trio.to_thread.run_sync(agent)
    assert codes == [(404, "session_not_found"), (404, "model_not_found"),
                     (400, "invalid_messages"), (400, "invalid_messages"),
                     (400, "invalid_messages"), (400, "invalid_tools"),
                     (400, "unsupported_parameter"), (400, "unsupported_parameter"),
                     (400, "invalid_sampling"), (400, "context_length_exceeded"),
                     (404, "session_required")]
    async with httpx.AsyncClient(base_url=served.url) as http:
        junk = await http.post("/sessions/bad/v1/chat/completions", content=b"{not json")
        assert (junk.status_code, junk.json()["error"]["code"]) == (400, "invalid_json")
        again = await http.post("/sessions", json={"id": "bad"})
        assert again.status_code == 409
        budget = await http.post("/sessions", json={"id": "b2", "budget": {"max_calls": -1}})
        assert budget.status_code == 400
        assert (await http.post("/sessions/bad/close")).status_code == 200
        closed = await http.post("/sessions/bad/v1/chat/completions",
                                 json={"model": MODEL, "messages": MESSAGES})
        assert (closed.status_code, closed.json()["error"]["code"]) == (400, "session_closed")
        assert (await http.delete("/sessions/bad")).status_code == 200
        assert (await http.get("/sessions/bad")).status_code == 404
        assert (await http.get("/health")).status_code == 200
    assert served.seen == []  # nothing refused reached the engine


def test_replies_are_parsed_strictly() -> None:
    tools = parse_tools(TOOLS)
    assert parse_reply(CALL_TEXT, tools)[1][0].name == "read_file"
    for text in ['<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
                 '<tool_call>{"name": "read_file", "arguments": [1]}</tool_call>',
                 "<tool_call>{not json}</tool_call>", '<tool_call>{"name": "read_file"',
                 '<tool_call>{"name": "read_file", "arguments": {"path": 7}}</tool_call>',
                 CALL_TEXT + "<tool_call>[]</tool_call>"]:
        assert parse_reply(text, tools) == (text, ())


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.delenv(var, raising=False)
    yield


async def test_serve_model_answers_the_openai_endpoint_on_the_same_engine() -> None:
    # Given `streamrl serve-model --openai-port` (in process): one engine, two protocols
    from streamrl.inference.server import serve_model

    tiny = resolve_model("tiny")
    port, openai_port = free_port(), free_port()
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(serve_model, tiny, host="127.0.0.1", port=port,
                                    openai_port=openai_port))
        async with httpx.AsyncClient(timeout=60) as http:
            created = await http.post(f"http://127.0.0.1:{openai_port}/sessions",
                                      json={"id": "ep"})
            base_url = created.json()["base_url"]
            client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
            ask = partial(client.chat.completions.create, model=MODEL, messages=MESSAGES,
                          max_tokens=3, temperature=0)
            # When the agent asks, the weights are updated over SGLang's API, it asks again
            await trio.to_thread.run_sync(ask)
            r = await http.post(f"http://127.0.0.1:{port}/update_weights_from_disk",
                                json={"model_path": str(tiny), "weight_version": "1"})
            assert r.json()["success"], r.text
            await trio.to_thread.run_sync(ask)
            record = (await http.get(f"http://127.0.0.1:{openai_port}/sessions/ep")).json()
        nursery.cancel_scope.cancel()
    # Then each call records the engine version that produced it
    assert [set(c["versions"]) for c in record["calls"]] == [{0}, {1}]
