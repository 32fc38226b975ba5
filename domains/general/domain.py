"""The ``general`` domain: short instructions and questions with one exact answer, EVAL ONLY.

A held-out probe of general capability next to the trained domains, so that forgetting shows
up in the per-domain evaluation series (list it in ``scheduler.eval_domains``; it has no
training split, and ``load_items("train")`` refuses, so it can never be trained on by
mistake). Items: capitals, opposites, upper-casing, reversing and repeating a word, sorting
words, the next weekday, small sums, the larger of two numbers, counting words.

Scoring is exact after normalisation: the reply's text after its last ``Answer:`` (else its
first non-empty line), or what follows the last " is " in it ("The capital of Italy is
Rome.", the way small models answer), lower-cased, surrounding quotes, asterisks, backticks
and a final period removed, whitespace collapsed, spaces around commas dropped, must equal
the expected answer normalised the same way: 1.0 or 0.0. Nothing runs in the sandbox.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgspec

from streamrl.domains.base import NO_SANDBOX, SINGLE_TURN, SplitFiles, chat_prompt_ids
from streamrl.sandbox.base import ExecRequest, ExecResult

DATA_DIR = Path(__file__).parent / "data"
MAX_NEW_TOKENS = 32
MAX_REPLY_CHARS = 200
INSTRUCTION = "Reply with only the answer."

_ANSWER = re.compile(r"answer\s*(?:is)?\s*[:=]\s*(.*)", re.IGNORECASE)


class GeneralItem(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    prompt: str
    answer: str
    kind: str


def normalize(text: str) -> str:
    text = " ".join(text.split()).lower()
    text = text.strip().strip("*`\"'").strip().rstrip(".").strip().strip("*`\"'").strip()
    return re.sub(r"\s*,\s*", ",", text)


def extract_reply(text: str) -> str | None:
    """The answer part of a reply: after the last ``Answer:``, else the first non-empty line."""
    found = _ANSWER.findall(text[-2000:])
    if found:
        return found[-1].strip() or None
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return None


class General(SplitFiles):
    name = "general"
    item_type = GeneralItem
    default_max_new_tokens = MAX_NEW_TOKENS
    episode = SINGLE_TURN
    sandbox = NO_SANDBOX
    eval_only = True

    def __init__(self, data_dir: Path = DATA_DIR) -> None:
        self.data_dir = data_dir

    def load_items(self, split: str) -> list[Any]:
        if split == "train":
            raise ValueError("the general domain is eval-only: list it in "
                             "scheduler.eval_domains, not scheduler.domains")
        return super().load_items(split)

    def render_prompt(self, item: GeneralItem, tokenizer: Any) -> list[int]:
        return chat_prompt_ids(tokenizer, f"{item.prompt} {INSTRUCTION}")

    def exec_request(self, item: GeneralItem, completion_text: str) -> ExecRequest | None:
        return None

    def score(self, item: GeneralItem, completion_text: str, result: ExecResult | None
              ) -> float:
        reply = extract_reply(completion_text)
        if reply is None or len(reply) > MAX_REPLY_CHARS:
            return 0.0
        candidates = {normalize(reply), normalize(reply.rpartition(" is ")[2])}
        return 1.0 if normalize(item.answer) in candidates else 0.0
