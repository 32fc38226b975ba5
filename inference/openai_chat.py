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
  knows tools; else the tools go into the system prompt in the hermes style (the
  ``<tools>`` block, calls as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``),
  and earlier calls are rendered that way too; tool results are ``tool`` messages (as one
  ``<tool_response>`` user turn each where the template refuses the role);
- :func:`parse_reply` is strict: a reply's calls are taken only if every
  ``<tool_call>...</tool_call>`` block is a JSON object naming a declared tool with an
  object of arguments; otherwise the whole text is the reply's content and there is no call
  (the agent sees what the model wrote).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
HERMES_TOOLS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


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
        tools.append({"type": "function", "function": {
            "name": fn["name"], "description": str(fn.get("description") or ""),
            "parameters": params}})
    return tools


# ---------------------------------------------------------------------------- rendering


def native_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders ``tools=`` itself."""
    return "tools" in str(getattr(tokenizer, "chat_template", "") or "")


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
        block = HERMES_TOOLS.format(tools="\n".join(json.dumps(t, ensure_ascii=False)
                                                    for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def render(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
           generation_prompt: bool) -> str:
    """The chat template's text of already converted ``messages`` (:func:`template_messages`)."""
    kwargs: dict[str, Any] = {"tools": tools} if tools and native_tools(tokenizer) else {}
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


def parse_reply(text: str, tool_names: set[str]) -> tuple[str, tuple[ToolCall, ...]]:
    """``(content, calls)`` of a model reply (see the module docstring: strict)."""
    calls = []
    for block in CALL_BLOCK.finditer(text):
        try:
            obj = json.loads(block.group(1))
        except ValueError:
            return text, ()
        if not isinstance(obj, dict):
            return text, ()
        name, args = obj.get("name"), obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return text, ()
        if not isinstance(name, str) or name not in tool_names or not isinstance(args, dict):
            return text, ()
        calls.append(ToolCall(name, json.dumps(args, sort_keys=True, ensure_ascii=False),
                              new_call_id()))
    if not calls:
        return text, ()
    return CALL_BLOCK.sub("", text).strip(), tuple(calls)
