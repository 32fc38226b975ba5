"""OpenAI chat messages and tools <-> the model's chat template (for :mod:`inference.openai_api`).

Guarantees:
- :func:`parse_messages` / :func:`parse_tools` accept the OpenAI request shapes (string or
  text-part content, assistant ``tool_calls`` with JSON-string arguments, ``tool`` messages
  with ``tool_call_id``; ``developer`` is read as ``system``) and refuse anything else with
  :class:`InvalidRequest` (an OpenAI-style 400), never an exception of another kind;
- two messages compare equal when they say the same thing: tool-call ids and the spelling of
  the arguments JSON (spacing, key order) do not count, so an agent that sends back the
  reply it got, through any client, matches it;
- :func:`render` uses the tokenizer's own chat template, with ``tools=`` where the template
  renders tools (:func:`inference.chat.supports_tools`); else the tools go into the system
  prompt in the hermes style (:func:`inference.chat.tools_system_prompt`: the ``<tools>``
  block, calls as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``),
  and earlier calls are rendered that way too; tool results are ``tool`` messages (as one
  ``<tool_response>`` user turn each where the template refuses the role);
- :func:`parse_reply` is strict (:func:`inference.chat.parse_tool_calls`, in the template's
  format): a reply's calls are taken only if every one is strict JSON naming a declared tool
  with arguments that validate against its schema; otherwise the whole text is the reply's
  content and there is no call (the agent sees what the model wrote). The reply is parsed
  from its text with special tokens skipped, so a format whose markers are special tokens
  (mistral's ``[TOOL_CALLS]``) is not recognised.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from streamrl.inference.chat import (
    Tool,
    ToolFormat,
    parse_tool_calls,
    supports_tools,
    tools_system_prompt,
)

ROLES = ("system", "user", "assistant", "tool")



class InvalidRequest(ValueError):
    """A request the endpoint refuses: answered as an OpenAI error (``status``, ``code``)."""

    def __init__(self, message: str, *, code: str = "invalid_request", param: str | None = None,
                 status: int = 400, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.code, self.param, self.status, self.kind = code, param, status, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param,
                          "code": self.code}}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # canonical JSON (sorted keys) of an object, or the raw string if not JSON
    id: str = field(default="", compare=False)

    def arguments_object(self) -> Any:
        try:
            return json.loads(self.arguments)
        except ValueError:
            return self.arguments

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Message:
    role: str
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""
    name: str = ""


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def canonical_json(raw: str) -> str:
    try:
        return json.dumps(json.loads(raw), sort_keys=True, ensure_ascii=False)
    except ValueError:
        return raw


def _content(raw: Any, where: str) -> str:
    if raw is None:
        return ""
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list) and all(isinstance(p, dict) for p in raw):
        if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in raw):
            raise InvalidRequest(f"{where}: only text content parts are supported",
                                 code="invalid_messages", param="messages")
        return "".join(p["text"] for p in raw)
    raise InvalidRequest(f"{where}: content must be a string or a list of text parts",
                         code="invalid_messages", param="messages")


def _tool_call(raw: Any, where: str) -> ToolCall:
    fn = raw.get("function") if isinstance(raw, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise InvalidRequest(f"{where}: a tool call needs function.name",
                             code="invalid_messages", param="messages")
    args = fn.get("arguments", "{}")
    if not isinstance(args, str):
        args = json.dumps(args)
    return ToolCall(fn["name"], canonical_json(args), str(raw.get("id") or ""))


def parse_messages(raw: Any) -> list[Message]:
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("messages must be a non-empty list", code="invalid_messages",
                             param="messages")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise InvalidRequest(f"{where} must be an object", code="invalid_messages",
                                 param="messages")
        role = "system" if m.get("role") == "developer" else m.get("role")
        if role not in ROLES:
            raise InvalidRequest(f"{where}: unknown role {m.get('role')!r}",
                                 code="invalid_messages", param="messages")
        calls = m.get("tool_calls") or []
        if (role != "assistant" and calls) or not isinstance(calls, list):
            raise InvalidRequest(f"{where}: tool_calls only in an assistant message, as a list",
                                 code="invalid_messages", param="messages")
        out.append(Message(
            role, _content(m.get("content"), where),
            tuple(_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)),
            str(m.get("tool_call_id") or "") if role == "tool" else "",
            str(m.get("name") or "") if role == "tool" else "",
        ))
    return out


def parse_tools(raw: Any) -> list[dict[str, Any]]:
    """The declared tools as ``{"type": "function", "function": {name, description,
    parameters}}``."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise InvalidRequest("tools must be a list", code="invalid_tools", param="tools")
    tools = []
    for i, t in enumerate(raw):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidRequest(f"tools[{i}]: need type 'function' and function.name",
                                 code="invalid_tools", param="tools")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise InvalidRequest(f"tools[{i}]: parameters must be a JSON schema object",
                                 code="invalid_tools", param="tools")
        if not isinstance(fn.get("description", ""), str):
            raise InvalidRequest(f"tools[{i}]: description must be a string",
                                 code="invalid_tools", param="tools")
        if _remote_ref(params):
            raise InvalidRequest(f"tools[{i}]: only local $ref ('#...') in parameters",
                                 code="invalid_tools", param="tools")
        try:
            tool = Tool.from_spec({"function": {**fn, "parameters": params}})
        except (ValueError, TypeError, KeyError, RecursionError) as exc:
            raise InvalidRequest(f"tools[{i}]: {exc}", code="invalid_tools", param="tools"
                                 ) from None
        tools.append(tool.spec())
    return tools


def _remote_ref(schema: Any) -> bool:
    """Whether a ``$ref`` / ``$dynamicRef`` in ``schema`` points outside it (never fetched:
    a validator would try to retrieve it when the model calls the tool)."""
    stack = [schema]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            refs = (value.get("$ref"), value.get("$dynamicRef"))
            if any(r is not None and not (isinstance(r, str) and r.startswith("#"))
                   for r in refs):
                return True
            stack += value.values()
        elif isinstance(value, list):
            stack += value
    return False


# ---------------------------------------------------------------------------- rendering


def native_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders ``tools=`` itself."""
    return supports_tools(tokenizer)


def _call_text(call: ToolCall) -> str:
    body = json.dumps({"name": call.name, "arguments": call.arguments_object()},
                      ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def template_messages(messages: list[Message], tools: list[dict[str, Any]], native: bool
                      ) -> list[dict[str, Any]]:
    """``messages`` as the dicts ``apply_chat_template`` takes (hermes style if not native)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.role == "assistant" and m.tool_calls and native:
            out.append({"role": "assistant", "content": m.content, "tool_calls": [
                {"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments_object()}}
                for c in m.tool_calls]})
        elif m.role == "assistant" and m.tool_calls:
            parts = [m.content] if m.content else []
            out.append({"role": "assistant",
                        "content": "\n".join([*parts, *map(_call_text, m.tool_calls)])})
        elif m.role == "tool":
            out.append({"role": "tool", "content": m.content, "tool_call_id": m.tool_call_id,
                        **({"name": m.name} if m.name else {})})
        else:
            out.append({"role": m.role, "content": m.content})
    if tools and not native:
        declared = [Tool.from_spec(t) for t in tools]
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system",
                      "content": tools_system_prompt(declared, out[0]["content"])}
        else:
            out.insert(0, {"role": "system", "content": tools_system_prompt(declared)})
    return out


def render(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
           generation_prompt: bool, native: bool) -> str:
    """The chat template's text of already converted ``messages`` (:func:`template_messages`)."""
    kwargs: dict[str, Any] = {"tools": tools} if tools and native else {}
    from jinja2 import TemplateError

    def apply(convo: list[dict[str, Any]]) -> str:
        return str(tokenizer.apply_chat_template(convo, tokenize=False,
                                                 add_generation_prompt=generation_prompt, **kwargs))

    try:
        try:
            return apply(messages)
        except TemplateError:
            if not any(m["role"] == "tool" for m in messages):
                raise
            return apply([_as_user(m) if m["role"] == "tool" else m for m in messages])
    except TemplateError as exc:  # a template's own raise_exception on what it refuses
        raise InvalidRequest(f"the chat template refused the messages: {exc}",
                             code="invalid_messages", param="messages") from None


def _as_user(tool_message: dict[str, Any]) -> dict[str, Any]:
    """A tool result for a template that refuses the ``tool`` role (hermes style)."""
    return {"role": "user",
            "content": f"<tool_response>\n{tool_message['content']}\n</tool_response>"}


def encode(tokenizer: Any, text: str) -> list[int]:
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]


# ---------------------------------------------------------------------------- parsing


def parse_reply(text: str, tools: list[dict[str, Any]], fmt: ToolFormat = "hermes"
                ) -> tuple[str, tuple[ToolCall, ...]]:
    """``(content, calls)`` of a model reply, through :func:`inference.chat.parse_tool_calls`
    (arguments checked against the tool's schema). Strict: if any call is refused, the whole
    text is the content and there is no call."""
    declared = [Tool.from_spec(t) for t in tools]
    parsed = parse_tool_calls(text, declared, fmt)
    if not parsed.calls or any(c.error for c in parsed.calls):
        return text, ()
    return parsed.content, tuple(
        ToolCall(c.name, json.dumps(c.arguments, sort_keys=True, ensure_ascii=False),
                 new_call_id()) for c in parsed.calls)
