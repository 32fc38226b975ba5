"""SFT data sets: chat rows rendered with the model's own template into the tokens an RL
episode of the same conversation has (the mask on the assistant turns only), with the
template's own tools or the hermes fallback; token rows; JSONL, Parquet and a saved
``datasets`` data set alike; rows that cannot be rendered refused, named; the order."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from streamrl.config.schema import load_config
from streamrl.domains.base import chat_observation_ids
from streamrl.inference.chat import (
    Tool,
    ToolResult,
    prompt_ids,
    supports_tools,
    tool_results_ids,
)
from streamrl.learner.sft_data import (
    RowError,
    SFTData,
    load_sft_data,
    next_position,
    render_chat,
)
from streamrl.models import load_tokenizer, resolve_model

READ = {"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the repository.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}  # fmt: skip
FINISH = {"type": "function", "function": {
    "name": "finish", "description": "Done.", "parameters": {"type": "object", "properties": {}}}}

QWEN_LIKE = (
    "{%- if tools %}{{ '<|im_start|>system\\n# Tools\\n<tools>' }}{% for t in tools %}"
    "{{ '\\n' + (t | tojson) }}{% endfor %}{{ '\\n</tools><|im_end|>\\n' }}{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{ '<|im_start|>assistant\\n' + m.content }}"
    "{%- for c in m.tool_calls or [] %}{{ '\\n<tool_call>\\n{\"name\": \"' + c.function.name"
    " + '\", \"arguments\": ' + (c.function.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}{{ '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}{{ '<|im_start|>user\\n<tool_response>\\n' + m.content"
    " + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""A template that renders tools and tool calls itself (Qwen2.5's layout, shortened)."""


@pytest.fixture
def tokenizer() -> Any:
    """The tiny model's tokenizer: SmolLM2's, whose template renders no tools."""
    return load_tokenizer(resolve_model("tiny"))


def tool_row(arguments: Any = None) -> dict[str, Any]:
    """A repository episode: read the file, see it, finish."""
    args = {"path": "calc.py"} if arguments is None else arguments
    return {"messages": [
        {"role": "system", "content": "You fix Python repositories."},
        {"role": "user", "content": "The test of add fails."},
        {"role": "assistant", "content": "Let me read it.", "tool_calls": [
            {"type": "function", "function": {"name": "read_file", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "def add(a, b):\n    return a - b"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "finish", "arguments": "{}"}}]},
    ], "tools": [READ, FINISH]}  # fmt: skip


def pieces(tokenizer: Any, tokens: list[int], mask: list[int]) -> list[tuple[int, str]]:
    """The completion as runs of equal mask, decoded."""
    out: list[tuple[int, list[int]]] = []
    for t, m in zip(tokens, mask, strict=True):
        if out and out[-1][0] == m:
            out[-1][1].append(t)
        else:
            out.append((m, [t]))
    return [(m, tokenizer.decode(ids)) for m, ids in out]


def test_tool_row_renders_as_the_rl_episode_with_only_the_assistant_turns_trained(
    tokenizer: Any,
) -> None:
    # Given a chat row with tool calls, and a template without tool support (hermes fallback)
    assert not supports_tools(tokenizer)
    row = tool_row()
    # When it is rendered
    prompt, tokens, mask = render_chat(tokenizer, row["messages"], row["tools"])
    # Then the prompt is the RL episode's first prompt: the tools declared in the system message
    tools = [Tool.from_spec(t) for t in row["tools"]]
    assert prompt == prompt_ids(tokenizer, row["messages"][:2], tools)
    # and the completion is: turn 1 (trained), the tool result as the generator appends it
    # after a turn that ended with its end-of-turn token (masked), turn 2 (trained)
    call = '<tool_call>\n{"name": "read_file", "arguments": {"path": "calc.py"}}\n</tool_call>'
    result = tool_results_ids(tokenizer, [ToolResult(call_id="call_0", name="read_file",
                              content="def add(a, b):\n    return a - b")], True, tools)
    assert pieces(tokenizer, tokens, mask) == [
        (1, f"Let me read it.\n{call}<|im_end|>"),
        (0, tokenizer.decode(result)),
        (1, '<tool_call>\n{"name": "finish", "arguments": {}}\n</tool_call><|im_end|>'),
    ]
    # and the whole decodes to the template's rendering of the conversation, up to its end
    whole = tokenizer.decode(prompt + tokens)
    assert whole.startswith("<|im_start|>system\nYou fix Python repositories.\n\n# Tools")
    assert whole.endswith('</tool_call><|im_end|>')


def test_template_with_its_own_tools_renders_them_and_the_calls(tokenizer: Any) -> None:
    # Given a template that renders tools and tool calls itself
    tokenizer.chat_template = QWEN_LIKE
    assert supports_tools(tokenizer)
    row = tool_row()
    # When the row is rendered
    prompt, tokens, mask = render_chat(tokenizer, row["messages"], row["tools"])
    # Then the tools are the template's, the calls its own rendering, the result masked
    tools = [Tool.from_spec(t) for t in row["tools"]]
    assert prompt == prompt_ids(tokenizer, row["messages"][:2], tools)
    assert tokenizer.decode(prompt).startswith("<|im_start|>system\n# Tools\n<tools>\n{")
    got = pieces(tokenizer, tokens, mask)
    assert [m for m, _ in got] == [1, 0, 1]
    assert got[0][1] == ('Let me read it.\n<tool_call>\n{"name": "read_file", "arguments": '
                         '{"path": "calc.py"}}\n</tool_call><|im_end|>')
    assert got[1][1] == ("\n<|im_start|>user\n<tool_response>\ndef add(a, b):\n    return a - b"
                         "\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_plain_chat_trains_every_assistant_turn_and_masks_the_users(tokenizer: Any) -> None:
    # Given a two-turn chat without tools
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                {"role": "user", "content": "and 3+3?"}, {"role": "assistant", "content": "6"}]
    # When it is rendered
    prompt, tokens, mask = render_chat(tokenizer, messages)
    # Then the second user turn is masked as the generator appends an observation
    assert pieces(tokenizer, tokens, mask) == [
        (1, "4<|im_end|>"),
        (0, tokenizer.decode(chat_observation_ids(tokenizer, "and 3+3?", closed=True))),
        (1, "6<|im_end|>"),
    ]
    assert tokenizer.decode(prompt).endswith("<|im_start|>user\n2+2?<|im_end|>\n"
                                             "<|im_start|>assistant\n")


@pytest.mark.parametrize(("row", "why"), [
    (tool_row(arguments="{not json"), "arguments are not JSON"),
    (tool_row(arguments={"path": 3}), "do not parse back"),  # against read_file's schema
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message"),
    ({"messages": [{"role": "assistant", "content": "hi"}]}, "no prompt"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "role 'robot'"),
    ({"messages": [{"role": "user", "content": "x"},
                   {"role": "assistant", "content": "<tool_call>{oops</tool_call>"}]},
     "do not parse back"),
    ({"text": "no messages"}, "neither messages"),
    ({"prompt_ids": [1, 2], "completion_ids": [3, 4], "mask": [1]}, "2 completion ids, 1 mask"),
    ({"prompt_ids": [1], "completion_ids": [10**9]}, "outside the model's vocabulary"),
    ({"prompt_ids": [1], "completion_ids": [3, 4], "mask": [0, 0]}, "no token to train on"),
])  # fmt: skip
def test_a_row_that_cannot_be_an_example_is_refused_by_name(
    row: dict[str, Any], why: str, tokenizer: Any, tmp_path: Path
) -> None:
    # Given a data set whose second row is bad
    path = tmp_path / "sft.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (tool_row(), row)) + "\n")
    # When it is loaded, the load stops at that row, naming the file, the row and why
    with pytest.raises(RowError, match=rf"sft\.jsonl: row 1: .*{why}"):
        load_sft_data(str(path), tokenizer, vocab=49152)
    # and with skip_bad_rows the row is left out, its reason kept
    data = load_sft_data(str(path), tokenizer, vocab=49152, skip_bad_rows=True)
    assert len(data.examples) == 1 and len(data.refused) == 1 and why in data.refused[0]


def test_an_example_over_max_tokens_is_refused(tokenizer: Any, tmp_path: Path) -> None:
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps(tool_row()) + "\n")
    with pytest.raises(RowError, match="more than 50"):
        load_sft_data(str(path), tokenizer, max_tokens=50)


def test_jsonl_parquet_and_a_saved_dataset_give_the_same_examples(
    tokenizer: Any, tmp_path: Path
) -> None:
    # Given the same rows as JSONL, and as Parquet and a saved `datasets` data set, whose
    # columns fill absent fields with nulls and hold arguments and tools as JSON strings
    rows = [tool_row(), {"messages": [{"role": "user", "content": "2+2?"},
                                      {"role": "assistant", "content": "4"}]}]
    columnar = json.loads(json.dumps(rows))
    for r in columnar:
        for m in r["messages"]:
            for c in m.get("tool_calls", []):
                if not isinstance(c["function"]["arguments"], str):
                    c["function"]["arguments"] = json.dumps(c["function"]["arguments"])
        r["tools"] = json.dumps(r.get("tools", []))
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(columnar), tmp_path / "a.parquet")
    import datasets

    datasets.Dataset.from_list(columnar).save_to_disk(str(tmp_path / "saved"))
    # When each is loaded
    want = [(e.prompt_ids, e.tokens, e.mask)
            for e in load_sft_data(str(tmp_path / "a.jsonl"), tokenizer).examples]
    # Then the same examples come out, named by their place
    for source in ("a.parquet", "saved"):
        got = load_sft_data(str(tmp_path / source), tokenizer).examples
        assert [(e.prompt_ids, e.tokens, e.mask) for e in got] == want
        assert [e.id for e in got] == [f"{tmp_path / source}:0", f"{tmp_path / source}:1"]


def test_token_rows_keep_the_sampled_tokens_and_mask(tokenizer: Any, tmp_path: Path) -> None:
    path = tmp_path / "export.jsonl"
    path.write_text(json.dumps({"id": "t1-0", "prompt_ids": [1, 2], "completion_ids": [3, 4, 5],
                                "mask": [1, 0, 1], "reward": 1.0}) + "\n")
    [ex] = load_sft_data(str(path), tokenizer, vocab=49152).examples
    assert (ex.id, ex.prompt_ids, ex.tokens, ex.mask) == ("t1-0", [1, 2], [3, 4, 5], [1, 0, 1])


def test_the_order_is_a_permutation_per_epoch_and_resumes_from_the_ledger_ids(
    tokenizer: Any, tmp_path: Path
) -> None:
    # Given a data set of 5 examples
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"prompt_ids": [1], "completion_ids": [10 + i]}) + "\n"
                            for i in range(5)))
    data = load_sft_data(str(path), tokenizer, seed=7)
    # Then each epoch visits every example once, in an order of its own
    first = [data.example_at(p).tokens[0] for p in range(5)]
    second = [data.example_at(p).tokens[0] for p in range(5, 10)]
    assert sorted(first) == sorted(second) == [10, 11, 12, 13, 14]
    # and the same seed and examples give the same order (another rank, a restart)
    again = SFTData(load_sft_data(str(path), tokenizer).examples, seed=7)
    assert [again.example_at(p).tokens[0] for p in range(10)] == first + second
    assert again.fingerprint == data.fingerprint
    # and the next position is the one after the last trained id of this data set
    steps = [data.trajectories(0, 3, 0), data.trajectories(3, 3, 1)]
    ids = [t.episode_id for step in steps for t in step] + ["sft-other-99", "abc"]
    assert next_position(ids, data) == 6
    assert next_position([], data) == 0
    assert [t.rollout.task.item_id for t in steps[1]] == [
        f"{path}:{[10, 11, 12, 13, 14].index(data.example_at(p).tokens[0])}" for p in (3, 4, 5)]


def test_sft_mode_needs_a_data_set() -> None:
    with pytest.raises(ValueError, match=r"needs learner\.sft\.data"):
        load_config(None, ["learner.mode=sft"])
    assert load_config(None, ["learner.mode=sft", "learner.sft.data=x.jsonl"]).learner.mode == "sft"
