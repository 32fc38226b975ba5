"""The domain contract: where tasks come from and how a completion is scored.

A domain is a data set of items plus a verifier. Guarantees every domain keeps:
- ``item_type`` is a msgspec-convertible type (a ``msgspec.Struct``) with at least ``id`` and
  ``prompt`` fields; items travel on the wire as ``msgspec.to_builtins(item)`` in
  ``Task.spec`` and are rebuilt with ``msgspec.convert(spec, domain.item_type)``;
- ``load_items(split)`` is deterministic, and the ``"train"`` and ``"eval"`` splits share no
  prompt;
- ``render_prompt`` uses the model's own chat template;
- ``exec_request`` and ``score`` never raise for anything the model wrote: code that is
  missing, malformed, crashing or hanging just scores low. ``score`` is in [0, 1].
"""

from __future__ import annotations

from typing import Any, Protocol

from sandbox.base import ExecRequest, ExecResult


class Domain(Protocol):
    name: str
    item_type: type
    default_max_new_tokens: int  # the calibrated generation budget for this domain

    def load_items(self, split: str) -> list[Any]: ...

    def render_prompt(self, item: Any, tokenizer: Any) -> list[int]: ...

    def exec_request(self, item: Any, completion_text: str) -> ExecRequest | None: ...

    def score(self, item: Any, completion_text: str, result: ExecResult | None) -> float: ...


def chat_prompt_ids(tokenizer: Any, user: str, system: str | None = None) -> list[int]:
    """Token ids of a one-turn chat, ending with the assistant header (generation prompt)."""
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": user})
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding by default
        ids = ids["input_ids"]
    return [int(i) for i in ids]
