"""Tool calls in the model's own chat format: declare tools, render them, parse calls, answer.

A tool is declared as :class:`Tool` (name, description, JSON-schema ``parameters``). The
flow of one agentic turn, token in, token out:

1. :func:`prompt_ids` renders the conversation with the tools through the tokenizer's chat
   template (``apply_chat_template(..., tools=...)``) where the template renders tools
   (:func:`supports_tools`: it renders a probe differently with them), else with one
   hermes-style system prompt, :data:`TOOLS_PROMPT`, in front of the domain's own;
2. the model's reply (its text; for formats whose markers are special tokens, decoded with
   ``skip_special_tokens=False``) goes through :func:`parse_tool_calls`, in the format the
   template uses (:func:`tool_format`: ``hermes`` ``<tool_call>{json}</tool_call>``,
   ``mistral`` ``[TOOL_CALLS][{json}, ...]``, ``llama3`` a reply that is one JSON object
   ``{"name", "parameters"}``; ``hermes`` wherever the fallback prompt is used);
3. every call's :class:`ToolResult` goes back as a ``tool`` message: :func:`tool_results_ids`
   gives the token ids that close the model's turn, add the results and open the next
   assistant turn, in the template (as ``domains.base.chat_observation_ids`` does for one
   observation); :class:`Transcript` keeps the ids and the loss mask (1 on model tokens only).

Guarantees:
- :func:`parse_tool_calls` never raises for anything the model wrote. Each call it finds is a
  :class:`ToolCall`: either valid (a declared tool; arguments a JSON object that validates
  against the tool's schema, JSON Schema 2020-12 via ``jsonschema``) or refused, with
  ``error`` set to a short message (malformed JSON, duplicate keys, NaN, nesting too deep, a
  call over ``max_call_chars``, an unclosed tag, an unknown tool, bad arguments, more than
  ``max_calls`` calls) that :func:`error_result` turns into an error tool result;
- error messages are bounded (``MESSAGE_CHARS`` each): a huge argument never echoes back;
- token ids come from the tokenizer's own template; a template whose rendering of a
  conversation is not a prefix of its continuation is refused (``ValueError``) up front.

Not covered: reasoning blocks (``<think>``) are left in ``content``; a template that renders
tool results only after an assistant message with ``tool_calls`` in a way the dummy turn does
not reproduce would need its own observation renderer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

ToolFormat = Literal["hermes", "mistral", "llama3"]

MAX_CALLS = 8  # calls parsed per reply; the rest are refused
MAX_CALL_CHARS = 256 * 1024  # one call's JSON text (write_file content rides in it)
MESSAGE_CHARS = 300  # one error message
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")

TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""
"""The hermes-style system prompt for templates that do not render tools (Qwen2.5's wording;
``{tools}``: one JSON function signature a line, as :meth:`Tool.spec` gives)."""


class Tool(msgspec.Struct, frozen=True, kw_only=True):
    """A tool the model may call: ``parameters`` is a JSON schema of its arguments object
    (checked when the tool is declared: a bad schema is a domain's bug, ``ValueError``)."""

    name: str
    description: str
    parameters: dict[str, Any] = msgspec.field(
        default_factory=lambda: {"type": "object", "properties": {}})

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"tool name {self.name!r}: letters, digits, _ . - (at most 64)")
        if self.parameters.get("type") != "object":
            raise ValueError(f"tool {self.name!r}: parameters must be a schema of type object")
        try:
            Draft202012Validator.check_schema(self.parameters)
        except SchemaError as exc:
            raise ValueError(f"tool {self.name!r}: bad parameters schema: {exc.message}") from None

    def spec(self) -> dict[str, Any]:
        """The OpenAI / chat-template form: ``{"type": "function", "function": {...}}``."""
        return {"type": "function", "function": {
            "name": self.name, "description": self.description, "parameters": self.parameters}}

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> Tool:
        """A tool from its OpenAI form (``{"type": "function", "function": {...}}``)."""
        fn = spec.get("function", spec)
        return cls(name=fn["name"], description=fn.get("description", ""),
                   parameters=fn.get("parameters") or {"type": "object", "properties": {}})


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    """One call found in a reply. ``error`` non-empty: refused (``name`` may be ``""``,
    ``arguments`` empty); answer it with :func:`error_result`."""

    id: str
    name: str
    arguments: dict[str, Any] = msgspec.field(default_factory=dict)
    error: str = ""


class ParsedReply(msgspec.Struct, frozen=True, kw_only=True):
    """A reply: its text outside the calls, and the calls in order."""

    content: str
    calls: list[ToolCall]


class ToolResult(msgspec.Struct, frozen=True, kw_only=True):
    """What a call returned, as the text of a ``tool`` message."""

    call_id: str
    name: str
    content: str
    error: bool = False


def error_result(call: ToolCall, message: str = "") -> ToolResult:
    """The error tool result of a refused call (or of ``message`` for a valid one)."""
    return ToolResult(call_id=call.id, name=call.name, error=True,
                      content=f"error: {_clip(message or call.error)}")


# --------------------------------------------------------------------------- rendering


def _render(tokenizer: Any, messages: list[dict[str, Any]], **kw: Any) -> str:
    return str(tokenizer.apply_chat_template(messages, tokenize=False, **kw))


_PROBE = Tool(name="streamrl_probe_tool", description="probe",
              parameters={"type": "object", "properties": {"x": {"type": "string"}}})


def supports_tools(tokenizer: Any) -> bool:
    """The template renders tools: a probe conversation renders differently with them."""
    convo = [{"role": "user", "content": "x"}]
    try:
        return _render(tokenizer, convo, tools=[_PROBE.spec()]) != _render(tokenizer, convo)
    except Exception:  # a template that raises on tools= does not support them
        return False


def tool_format(tokenizer: Any) -> ToolFormat:
    """How this model writes calls: the template's own format, else ``hermes``."""
    if not supports_tools(tokenizer):
        return "hermes"
    source = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    if "[TOOL_CALLS]" in source:
        return "mistral"
    if "<tool_call>" not in source and ("<|python_tag|>" in source or '"parameters"' in source):
        return "llama3"
    return "hermes"


def tools_system_prompt(tools: Sequence[Tool], system: str = "") -> str:
    """``system`` followed by :data:`TOOLS_PROMPT` listing ``tools``."""
    listed = "\n".join(json.dumps(t.spec(), ensure_ascii=False) for t in tools)
    prompt = TOOLS_PROMPT.format(tools=listed)
    return f"{system}\n\n{prompt}" if system else prompt


def prompt_ids(tokenizer: Any, messages: list[dict[str, Any]], tools: Sequence[Tool]) -> list[int]:
    """Token ids of ``messages`` with ``tools`` declared, ending with the assistant header.
    Without template support the tools go into the (first) system message."""
    if tools and not supports_tools(tokenizer):
        messages = list(messages)
        if messages and messages[0].get("role") == "system":
            messages[0] = {**messages[0],
                           "content": tools_system_prompt(tools, messages[0]["content"])}
        else:
            messages.insert(0, {"role": "system", "content": tools_system_prompt(tools)})
        tools = ()
    extra = {"tools": [t.spec() for t in tools]} if tools else {}
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        **extra)
    if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding by default
        ids = ids["input_ids"]
    return [int(i) for i in ids]


_TURN_MARK = "\x00streamrl-turn\x00"


def tool_messages(results: Sequence[ToolResult]) -> list[dict[str, Any]]:
    """The ``tool`` messages of ``results`` (OpenAI form: ``tool_call_id``, ``name``)."""
    return [{"role": "tool", "tool_call_id": r.call_id, "name": r.name, "content": r.content}
            for r in results]


def tool_results_ids(tokenizer: Any, results: Sequence[ToolResult], closed: bool,
                     tools: Sequence[Tool] = ()) -> list[int]:
    """Token ids that close the model's turn (unless ``closed``: its completion already ended
    with the end-of-turn token), add ``results`` as ``tool`` messages and open the next
    assistant turn, all in the template. A template that refuses the ``tool`` role gets them
    as one ``user`` message of ``<tool_response>`` blocks."""
    extra = {"tools": [t.spec() for t in tools]} if tools and supports_tools(tokenizer) else {}
    convo = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _TURN_MARK}]
    before = _render(tokenizer, convo, **extra)
    try:
        after = _render(tokenizer, [*convo, *tool_messages(results)],
                        add_generation_prompt=True, **extra)
    except Exception:  # the template refuses the tool role (raise_exception in jinja)
        text = "\n".join(f"<tool_response>\n{r.content}\n</tool_response>" for r in results)
        after = _render(tokenizer, [*convo, {"role": "user", "content": text}],
                        add_generation_prompt=True, **extra)
    if not after.startswith(before):
        raise ValueError("chat template: a conversation does not render as a prefix of its "
                         "continuation; cannot append tool results")
    closing = before[before.index(_TURN_MARK) + len(_TURN_MARK):]
    eos = getattr(tokenizer, "eos_token", None) or ""
    if closed and eos and closing.startswith(eos):
        closing = closing[len(eos):]
    text = closing + after[len(before):]
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]


@dataclass
class Transcript:
    """A multi-turn conversation as token ids and the loss mask: 1 on model tokens, 0 on the
    prompt and on everything the template wraps around tool results."""

    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, prompt: Sequence[int]) -> Transcript:
        return cls(list(prompt), [0] * len(prompt))

    def add_model(self, ids: Sequence[int]) -> None:
        self.ids += ids
        self.mask += [1] * len(ids)

    def add_observation(self, ids: Sequence[int]) -> None:
        self.ids += ids
        self.mask += [0] * len(ids)


# --------------------------------------------------------------------------- parsing


def parse_tool_calls(text: str, tools: Sequence[Tool], fmt: ToolFormat = "hermes", *,
                     max_calls: int = MAX_CALLS,
                     max_call_chars: int = MAX_CALL_CHARS) -> ParsedReply:
    """The calls in a reply, each validated against ``tools`` (see the module docstring).
    Never raises for what the text holds."""
    if fmt == "mistral" and len(text) > max_calls * max_call_chars:
        return ParsedReply(content="", calls=[ToolCall(id="call_0", name="", error=(
            f"calls too large ({len(text)} characters, at most {max_call_chars} each)"))])
    content, raw = _SPLITTERS[fmt](text)
    by_name = {t.name: t for t in tools}
    calls = []
    for i, item in enumerate(raw):
        cid = f"call_{i}"
        if i >= max_calls:
            calls.append(ToolCall(id=cid, name="", error=f"too many calls in one reply (at "
                                  f"most {max_calls}); this one was not run"))
        elif isinstance(item, _Refused):
            calls.append(ToolCall(id=cid, name="", error=item.why))
        else:
            calls.append(_checked_call(cid, item, by_name, fmt, max_call_chars))
    return ParsedReply(content=content, calls=calls)


@dataclass(frozen=True)
class _Refused:
    why: str


def _split_hermes(text: str) -> tuple[str, list[str | _Refused]]:
    open_, close = "<tool_call>", "</tool_call>"
    content: list[str] = []
    raw: list[str | _Refused] = []
    pos = 0
    while (start := text.find(open_, pos)) >= 0:
        content.append(text[pos:start])
        end = text.find(close, start + len(open_))
        if end < 0:
            raw.append(_Refused(f"unclosed {open_}: write {open_}{{json}}{close}"))
            pos = len(text)
            break
        raw.append(text[start + len(open_):end])
        pos = end + len(close)
    content.append(text[pos:])
    rest = "".join(content)
    if close in rest:
        raw.append(_Refused(f"{close} without {open_}"))
        rest = rest.replace(close, "")
    return rest.strip(), raw


def _split_mistral(text: str) -> tuple[str, list[str | _Refused]]:
    head, sep, body = text.partition("[TOOL_CALLS]")
    if not sep:
        return text.strip(), []
    try:
        items = _loads(body.strip())
    except ValueError as exc:
        return head.strip(), [_Refused(f"malformed JSON after [TOOL_CALLS]: {exc}")]
    if not isinstance(items, list):
        items = [items]
    return head.strip(), [json.dumps(it) for it in items]


def _split_llama3(text: str) -> tuple[str, list[str | _Refused]]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text.strip(), []
    return "", [body]


_SPLITTERS = {"hermes": _split_hermes, "mistral": _split_mistral, "llama3": _split_llama3}


def _checked_call(cid: str, raw: str, tools: dict[str, Tool], fmt: ToolFormat,
                  max_chars: int) -> ToolCall:
    if len(raw) > max_chars:
        return ToolCall(id=cid, name="", error=f"call too large ({len(raw)} characters, at "
                        f"most {max_chars})")
    try:
        obj = _loads(raw.strip())
    except ValueError as exc:
        return ToolCall(id=cid, name="", error=f"malformed JSON in the call: {exc}")
    args_key = "parameters" if fmt == "llama3" and isinstance(obj, dict) and (
        "parameters" in obj) else "arguments"
    if not isinstance(obj, dict) or set(obj) - {"name", args_key, "id"} or "name" not in obj:
        return ToolCall(id=cid, name="", error=f'a call is {{"name": <tool>, "{args_key}": '
                        f"<object>}}, got {_clip(raw.strip(), 80)}")
    name, args = obj["name"], obj.get(args_key, {})
    if not isinstance(name, str) or name not in tools:
        known = ", ".join(sorted(tools)) or "none"
        return ToolCall(id=cid, name="", error=f"unknown tool {_clip(repr(name), 80)} "
                        f"(tools: {known})")
    if not isinstance(args, dict):
        return ToolCall(id=cid, name=name, error=f"{args_key} must be a JSON object, not "
                        f"{type(args).__name__}")
    problems = validate_arguments(tools[name], args)
    if problems:
        return ToolCall(id=cid, name=name, error=f"bad arguments for {name}: "
                        + "; ".join(problems))
    return ToolCall(id=cid, name=name, arguments=args)


def validate_arguments(tool: Tool, arguments: dict[str, Any], most: int = 3) -> list[str]:
    """At most ``most`` short messages of what is wrong with ``arguments`` (none: valid)."""
    validator = Draft202012Validator(tool.parameters)
    out = []
    for error in sorted(validator.iter_errors(arguments), key=lambda e: list(e.path)):
        where = "/".join(str(p) for p in error.path)
        message, shown = error.message, repr(error.instance)
        if len(shown) > 60:  # a huge value is named by its start only
            message = message.replace(shown, _clip(shown, 40))
        out.append(_clip(f"{where}: {message}" if where else message, 160))
        if len(out) >= most:
            break
    return out


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise ValueError("duplicate key in a JSON object")
    return obj


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _loads(text: str) -> Any:
    """Strict JSON: no duplicate keys, no NaN / Infinity; errors as ``ValueError``."""
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{exc.msg} at line {exc.lineno} column {exc.colno}") from None


def _clip(text: str, limit: int = MESSAGE_CHARS) -> str:
    return text if len(text) <= limit else text[:limit] + f"... [{len(text) - limit} cut]"
