"""Agent sessions: one per episode, recording every chat call an external agent makes, as the
tokens the engine saw and produced.

Guarantees:
- a call's prompt reuses the engine's own tokens wherever the conversation extends an earlier
  call of the session (its messages, then the reply it got, then new ones: tool results, a
  user turn): that call's prompt ids + its completion ids exactly as the engine returned them
  + the tokens of the new messages, rendered with the model's chat template. Only the new
  messages are tokenized; the model's tokens never go through text again. A conversation
  that extends no earlier call (the agent rewrote its history or changed its tools) is
  rendered afresh and starts a new chain;
- every call records its prompt ids, completion ids, behaviour logprobs and per-token weight
  versions as the engine returned them (cut at a ``stop`` string with the text: the tokens up
  to the one that completed it). :meth:`Session.chains` gives each chain of calls as one
  sequence: the first prompt, then each completion (mask 1, its logprobs and versions) and
  the tokens the next call added (mask 0, logprob 0): what a trajectory trains on;
- budgets (:class:`Budget`) are checked before a call reaches the engine: ``max_calls``
  calls started, ``max_total_tokens`` tokens recorded (the new prompt tokens and the
  completion of every call, counting a completion's room while it runs, so concurrent calls
  cannot overshoot), and a wall clock from the session's creation that also bounds a running
  generation (cancelled, nothing recorded). A refused call raises :class:`InvalidRequest`
  and records nothing; a closed session takes no call but keeps its record until dropped;
- a prompt that does not fit the model's context is ``context_length_exceeded`` naming the
  context's size (an ``invalid_request_error``, not a budget); what the engine refuses is
  an :class:`InvalidRequest` too (400, or 503 when the engine is gone);
- a call is recorded only after its ``accept`` hook (the endpoint builds its answer there)
  returns: a call the client could not be answered is not trained on;
- prompts are rendered and tokenized in a worker thread, one at a time (the event loop
  serves other sessions meanwhile);
- a session id is 1 to 128 URL-safe characters (letters, digits, ``. _ ~ -``): it is a
  path segment of the session's base URL.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec
import numpy as np
import trio

from streamrl.inference.engine import Completion, Engine
from streamrl.inference.openai_chat import (
    InvalidRequest,
    Message,
    ToolCall,
    encode,
    native_tools,
    render,
    template_messages,
)
from streamrl.protocol.messages import Sample, Sampling, floats_to_bytes, ids_to_bytes

Generate = Callable[[list[list[int]], Sampling, str], Awaitable[list[Completion]]]
_MARK = "\x00streamrl-reply\x00"
SESSION_ID = re.compile(r"[A-Za-z0-9._~-]{1,128}")


def engine_generate(engine: Engine) -> Generate:
    """``engine.generate`` with the episode as the session where the engine takes one (the
    SGLang client: one server per episode, for its prefix cache)."""
    takes_session = "session" in inspect.signature(engine.generate).parameters

    async def generate(prompts: list[list[int]], sampling: Sampling, session: str
                       ) -> list[Completion]:
        if takes_session:
            return await engine.generate(prompts, sampling, session=session)  # type: ignore[call-arg]
        return await engine.generate(prompts, sampling)

    return generate


class Budget(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A session's limits (0: none)."""

    max_total_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    max_calls: Annotated[int, msgspec.Meta(ge=0)] = 0
    wall_clock_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    max_new_tokens: Annotated[int, msgspec.Meta(ge=1)] = 1024  # per call: caps max_tokens
    max_tool_calls: Annotated[int, msgspec.Meta(ge=0)] = 0  # calls of the session's tools


@dataclass(frozen=True)
class Call:
    """One recorded chat completion."""

    index: int
    parent: int  # the call this one extends (-1: rendered afresh)
    prompt_ids: list[int]
    new_from: int  # prompt_ids[:new_from] is the parent's prompt + completion
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # the engine's: stop, length (abort never records)
    text: str  # the completion's text (cut at a stop string)
    messages: tuple[Message, ...]  # the request's
    reply: Message  # the assistant message answered
    tools_key: str

    def to_builtins(self) -> dict[str, Any]:
        return {"index": self.index, "parent": self.parent, "prompt_ids": self.prompt_ids,
                "new_from": self.new_from, "completion_ids": self.completion_ids,
                "logprobs": self.logprobs, "versions": self.versions,
                "finish_reason": self.finish_reason, "text": self.text}


@dataclass(frozen=True)
class Chain:
    """Calls ``calls`` as one sequence (see the module docstring)."""

    calls: list[int]
    prompt_ids: list[int]
    tokens: list[int]  # after the prompt
    mask: list[int]
    logprobs: list[float]
    versions: list[int]

    def to_builtins(self) -> dict[str, Any]:
        return {"calls": self.calls, "prompt_ids": self.prompt_ids, "tokens": self.tokens,
                "mask": self.mask, "logprobs": self.logprobs, "versions": self.versions}

    def sample(self, text: str, finish_reason: str) -> Sample:
        """The chain as a trajectory member (``Episode.prompt_ids`` is ``prompt_ids``)."""
        versions = np.asarray(self.versions, np.int32)
        model = versions[np.asarray(self.mask, bool)] if self.mask else versions
        return Sample(tokens=ids_to_bytes(self.tokens), logprobs=floats_to_bytes(self.logprobs),
                      text=text, finish_reason=finish_reason,
                      weight_version=int(model.min()) if len(model) else 0,
                      mask=np.asarray(self.mask, np.uint8).tobytes(),
                      versions=ids_to_bytes(versions))


@dataclass(eq=False)
class Session:
    id: str
    budget: Budget
    created: float = field(default_factory=trio.current_time)
    calls: list[Call] = field(default_factory=list)
    closed: bool = False
    started_calls: int = 0
    reserved_tokens: int = 0
    tools: Any = None  # the episode's tool set over HTTP (ToolBox), if it has one
    tool_calls: int = 0
    pin: Sampling | None = None  # temperature and top_p every call samples at (training)

    @property
    def deadline(self) -> float:
        return self.created + self.budget.wall_clock_s if self.budget.wall_clock_s else math.inf

    def used_tokens(self) -> int:
        return sum(len(c.prompt_ids) - c.new_from + len(c.completion_ids) for c in self.calls)

    def chains(self) -> list[Chain]:
        parents = {c.parent for c in self.calls}
        chains = []
        for leaf in (c for c in self.calls if c.index not in parents):
            path = [leaf]
            while path[-1].parent >= 0:
                path.append(self.calls[path[-1].parent])
            path.reverse()
            tokens: list[int] = []
            mask: list[int] = []
            logprobs: list[float] = []
            versions: list[int] = []
            for i, call in enumerate(path):
                if i:
                    added = call.prompt_ids[call.new_from:]
                    tokens += added
                    mask += [0] * len(added)
                    logprobs += [0.0] * len(added)
                    versions += [versions[-1] if versions else 0] * len(added)
                tokens += call.completion_ids
                mask += [1] * len(call.completion_ids)
                logprobs += call.logprobs
                versions += call.versions
            chains.append(Chain([c.index for c in path], path[0].prompt_ids, tokens, mask,
                                logprobs, versions))
        return chains

    def summary(self) -> dict[str, Any]:
        return {"id": self.id, "closed": self.closed, "calls": len(self.calls),
                "tokens": self.used_tokens(), "tool_calls": self.tool_calls,
                "budget": msgspec.to_builtins(self.budget)}

    async def call_tool(self, name: str, arguments: Any) -> dict[str, Any]:
        """Run one call of the session's tool set (``tools.call(name, arguments)``, which
        answers ``{"content", "error"}`` and never raises for what the agent sent)."""
        if self.tools is None:
            raise InvalidRequest(f"session {self.id!r} has no tools", code="no_tools",
                                 status=404)
        if self.closed:
            raise InvalidRequest(f"session {self.id!r} is closed", code="session_closed")
        if trio.current_time() >= self.deadline:
            raise _budget("wall_clock_exceeded", f"the session's {self.budget.wall_clock_s} s "
                          "are spent")
        if self.budget.max_tool_calls and self.tool_calls >= self.budget.max_tool_calls:
            raise _budget("max_tool_calls_exceeded", f"the session's "
                          f"{self.budget.max_tool_calls} tool calls are spent")
        self.tool_calls += 1
        with trio.move_on_at(self.deadline):
            return await self.tools.call(name, arguments)  # type: ignore[no-any-return]
        raise _budget("wall_clock_exceeded", "the session's time ran out during the tool call")


class Sessions:
    """The endpoint's sessions and the one place a call becomes tokens, a generation and a
    record (see the module docstring)."""

    def __init__(self, generate: Generate, tokenizer: Any, stop_ids: set[int], *,
                 max_context: int = 1 << 30, max_sessions: int = 10_000) -> None:
        self.generate = generate
        self.tokenizer = tokenizer
        self.stop_ids = stop_ids
        self.max_context = max_context
        self.max_sessions = max_sessions
        self.native = native_tools(tokenizer)  # the template renders tools= itself
        self._sessions: dict[str, Session] = {}
        self._tokenizing = trio.CapacityLimiter(1)  # one thread renders and tokenizes

    @classmethod
    def for_engine(cls, engine: Any, tokenizer: Any = None, **kwargs: Any) -> Sessions:
        """Sessions over ``engine`` (its tokenizer and stop tokens where it has them, as the
        in-process engine does; else ``tokenizer`` and its end-of-sequence token)."""
        tokenizer = tokenizer if tokenizer is not None else engine.tokenizer
        stops = getattr(engine, "stop_ids", None) or {tokenizer.eos_token_id}
        model = getattr(engine, "model", None)
        context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        if context is not None:
            kwargs.setdefault("max_context", int(context))
        return cls(engine_generate(engine), tokenizer, {int(s) for s in stops}, **kwargs)

    def create(self, session_id: str, budget: Budget | None = None) -> Session:
        if not SESSION_ID.fullmatch(session_id):
            raise InvalidRequest(f"session id {session_id[:140]!r}: 1 to 128 of letters, "
                                 "digits and . _ ~ - (it is part of the base URL)", param="id")
        if session_id in self._sessions:
            raise InvalidRequest(f"session {session_id!r} exists", code="session_exists",
                                 status=409)
        if len(self._sessions) >= self.max_sessions:
            raise InvalidRequest("too many sessions", code="too_many_sessions", status=429)
        session = self._sessions[session_id] = Session(session_id, budget or Budget())
        return session

    def get(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise InvalidRequest(f"no session {session_id!r}", code="session_not_found",
                                 status=404)
        return session

    def close(self, session_id: str) -> Session:
        session = self.get(session_id)
        session.closed = True
        return session

    def drop(self, session_id: str) -> Session:
        session = self.get(session_id)
        del self._sessions[session_id]
        session.closed = True
        return session

    # ------------------------------------------------------------------ one call

    def prompt(self, session: Session, messages: list[Message], tools: list[dict[str, Any]]
               ) -> tuple[list[int], int, int]:
        """``(prompt ids, parent call or -1, new_from)`` for a request."""
        key = _tools_key(tools)
        native = self.native
        for call in sorted(session.calls, key=lambda c: (-len(c.messages), -c.index)):
            n = len(call.messages)
            if (call.tools_key != key or len(messages) <= n or tuple(messages[:n]) != call.messages
                    or messages[n] != call.reply):
                continue
            added = self._added(call, messages[n + 1:], tools, native)
            if added is not None:
                base = call.prompt_ids + call.completion_ids
                return base + added, call.index, len(base)
        text = render(self.tokenizer, template_messages(messages, tools, native), tools, True,
                      native)
        return encode(self.tokenizer, text), -1, 0

    def _added(self, call: Call, new: list[Message], tools: list[dict[str, Any]], native: bool
               ) -> list[int] | None:
        """The tokens after ``call``'s completion: the end of its turn (unless the completion
        ended with it) and the new messages, through the generation prompt; None if the
        template does not render the conversation as a prefix of its continuation."""
        convo = template_messages(list(call.messages), tools, native)
        convo.append({"role": "assistant", "content": _MARK})
        before = render(self.tokenizer, convo, tools, False, native)
        after = render(self.tokenizer, convo + template_messages(new, [], native), tools, True,
                       native)
        if not after.startswith(before) or before.count(_MARK) != 1:
            return None
        closing = before[before.index(_MARK) + len(_MARK):]
        ids = call.completion_ids
        if call.finish_reason == "stop" and ids and ids[-1] in self.stop_ids:
            end = self.tokenizer.decode([ids[-1]], skip_special_tokens=False)
            closing = closing.removeprefix(end) if closing.startswith(end) else closing
        return encode(self.tokenizer, closing + after[len(before):])

    async def complete(self, session: Session, messages: list[Message],
                       tools: list[dict[str, Any]], sampling: Sampling, stop: list[str],
                       parse: Callable[[str], tuple[str, tuple[ToolCall, ...]]],
                       accept: Callable[[Call], object] = lambda call: None) -> Call:
        """Generate and record one call (budgets first, see the module docstring); ``accept``
        sees the call before it is recorded, and nothing is recorded if it raises."""
        _admit(session)  # refuse early, before rendering
        prompt, parent, new_from = await trio.to_thread.run_sync(
            self.prompt, session, messages, tools, limiter=self._tokenizing)
        _admit(session)  # and again: the session may have moved on meanwhile
        room = self._room(session, prompt, new_from, sampling.max_new_tokens)
        if session.pin is not None:  # the learner recomputes logprobs at these
            sampling = msgspec.structs.replace(sampling, temperature=session.pin.temperature,
                                               top_p=session.pin.top_p)
        session.started_calls += 1
        session.reserved_tokens += room
        try:
            with trio.move_on_at(session.deadline):
                sampling = msgspec.structs.replace(sampling, max_new_tokens=room)
                completion = await self._generate(prompt, sampling, session.id)
                return self._record(session, messages, tools, prompt, parent, new_from,
                                    completion, stop, parse, accept)
            raise _budget("wall_clock_exceeded", f"the session's {session.budget.wall_clock_s} "
                          "s ran out during the call")
        finally:
            session.reserved_tokens -= room

    def _room(self, session: Session, prompt: list[int], new_from: int, asked: int) -> int:
        """The completion's room: ``asked``, cut to the session's ``max_new_tokens``, the
        model's context and the session's tokens left; refused when there is none."""
        if len(prompt) >= self.max_context:
            raise InvalidRequest(f"the prompt is {len(prompt)} tokens: the model's context is "
                                 f"{self.max_context} tokens, prompt and completion together",
                                 code="context_length_exceeded", param="messages")
        b = session.budget
        room = min(asked, b.max_new_tokens, self.max_context - len(prompt))
        if b.max_total_tokens:
            added, used = len(prompt) - new_from, session.used_tokens()
            left = b.max_total_tokens - used - session.reserved_tokens
            if left - added < 1:
                raise _budget("max_total_tokens_exceeded", f"no room for a completion: this "
                              f"call adds {added} prompt tokens, {used} of the session's "
                              f"{b.max_total_tokens} tokens are used and "
                              f"{session.reserved_tokens} held by running calls")
            room = min(room, left - added)
        return room

    async def _generate(self, prompt: list[int], sampling: Sampling, sid: str) -> Completion:
        """The engine's completion; what it refuses or fails at as :class:`InvalidRequest`."""
        try:
            [completion] = await self.generate([prompt], sampling, sid)
        except ValueError as exc:  # the engine refused the prompt (e.g. its context length)
            raise InvalidRequest(f"the engine refused the prompt: {exc}",
                                 code="context_length_exceeded", param="messages") from None
        except RuntimeError as exc:  # EngineClosed, ServerUnavailable, ProtocolError
            raise InvalidRequest(f"engine unavailable: {exc}", code="engine_unavailable",
                                 status=503, kind="server_error") from None
        return completion

    def _record(self, session: Session, messages: list[Message], tools: list[dict[str, Any]],
                prompt: list[int], parent: int, new_from: int, c: Completion, stop: list[str],
                parse: Callable[[str], tuple[str, tuple[ToolCall, ...]]],
                accept: Callable[[Call], object]) -> Call:
        tokens, logprobs = c.tokens.tolist(), c.logprobs.tolist()
        versions, text, reason = c.token_versions().tolist(), c.text, c.finish_reason
        if reason == "abort":
            raise InvalidRequest("the engine aborted the request", code="engine_aborted",
                                 status=503, kind="server_error")
        for i in range(1, len(tokens) + 1) if stop else ():
            prefix = self.tokenizer.decode(tokens[:i], skip_special_tokens=True)
            hit = next((s for s in stop if s in prefix), None)
            if hit is not None:
                tokens, logprobs, versions = tokens[:i], logprobs[:i], versions[:i]
                text, reason = prefix[: prefix.index(hit)], "stop"
                break
        content, calls = parse(text)
        call = Call(len(session.calls), parent, prompt, new_from, tokens, logprobs, versions,
                    reason, text, tuple(messages), Message("assistant", content, calls),
                    _tools_key(tools))
        accept(call)
        session.calls.append(call)
        return call


def _tools_key(tools: list[dict[str, Any]]) -> str:
    return msgspec.json.encode(tools, order="sorted").decode()


def _admit(session: Session) -> None:
    """Refuse a call to a closed session or past its wall clock or its ``max_calls``."""
    b = session.budget
    if session.closed:
        raise InvalidRequest(f"session {session.id!r} is closed", code="session_closed")
    if trio.current_time() >= session.deadline:
        raise _budget("wall_clock_exceeded", f"the session's {b.wall_clock_s} s are spent")
    if b.max_calls and session.started_calls >= b.max_calls:
        raise _budget("max_calls_exceeded", f"the session's {b.max_calls} calls are spent")


def _budget(code: str, message: str) -> InvalidRequest:
    return InvalidRequest(message, code=code, kind="budget_exceeded")
