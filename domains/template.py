"""How a declared domain's item is put to the model, and the error a bad declaration raises
(shared by :mod:`streamrl.domains.declared` and :mod:`streamrl.domains.gym`).

The conversation is the ``[domain.<name>.prompt]`` table's: an optional system message,
few-shot examples as user/assistant turns, then the item's user turn (``template`` filled
with ``{prompt}`` and the row's columns), always through the model's own chat template.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from streamrl.config.schema import PromptConfig
from streamrl.domains.kinds import Record

DEFAULT_MAX_NEW_TOKENS = 256
"""A declared domain's generation budget when neither its table nor its kind sets one."""


class DeclarationError(ValueError):
    """A declared domain that cannot be built or loaded: the message names the domain, the
    file and the row."""


# -- prompts ------------------------------------------------------------------------------


class _Blank(dict[str, Any]):
    def __missing__(self, key: str) -> str:
        return ""


def render_user(template: str, prompt: str, fields: Mapping[str, Any]) -> str:
    """The user turn; a column the template names must be in ``fields`` (KeyError)."""
    return template.format_map({**fields, "prompt": prompt})


def chat_messages(p: PromptConfig, item: Record, system: str = "") -> list[dict[str, str]]:
    """The conversation of ``item``: system, few-shot turns, then the item's user turn."""
    messages = [{"role": "system", "content": p.system or system}] if p.system or system else []
    for shot in p.few_shot:
        shot_turn = p.template.format_map(_Blank(prompt=shot.prompt))  # other columns: blank
        messages.append({"role": "user", "content": shot_turn})
        messages.append({"role": "assistant", "content": shot.answer})
    messages.append({"role": "user",
                     "content": render_user(p.template, item.prompt, {**item.extra,
                                                                      "id": item.id})})
    return messages


def chat_ids(tokenizer: Any, messages: list[dict[str, str]],
             response_prefix: str = "") -> list[int]:
    """The prompt's token ids: ``messages`` through the model's chat template, the
    assistant's turn opened, then ``response_prefix`` (the start of that turn, as text the
    model continues)."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding by default
        ids = ids["input_ids"]
    out = [int(i) for i in ids]
    if response_prefix:
        out += [int(i) for i in tokenizer.encode(response_prefix, add_special_tokens=False)]
    return out


def with_prefix(p: PromptConfig, completion_text: str) -> str:
    """The assistant's whole turn: the configured ``response_prefix`` and what the model
    wrote after it (what a domain runs and scores)."""
    return p.response_prefix + completion_text if p.response_prefix else completion_text


