"""Planted domains for the scorer-isolation and quarantine tests: ``planted-ok`` scores 1,
``planted-hang`` never returns, ``planted-raise`` raises, ``planted-crash`` kills its process,
``planted-unjudged`` cannot judge (:class:`~streamrl.domains.base.VerifierFailed`).
Importing this module registers them (in the test process, and in each scorer worker through
:func:`setup`)."""

from __future__ import annotations

import os
import time
from typing import Any

import msgspec

from streamrl.domains.base import NO_SANDBOX, SINGLE_TURN, VerifierFailed
from streamrl.domains.registry import register


class PlantedItem(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    prompt: str


class _Planted:
    item_type = PlantedItem
    default_max_new_tokens = 8
    episode = SINGLE_TURN
    sandbox = NO_SANDBOX
    name = "planted"

    def load_items(self, split: str) -> list[Any]:
        return [PlantedItem(id="0", prompt="p")]

    def render_prompt(self, item: Any, tokenizer: Any) -> list[int]:
        return [0]

    def exec_request(self, item: Any, completion_text: str) -> None:
        return None

    def score(self, item: Any, completion_text: str, result: Any) -> float:
        return 1.0


@register("planted-ok")
class PlantedOk(_Planted):
    name = "planted-ok"


@register("planted-hang")
class PlantedHang(_Planted):
    name = "planted-hang"

    def score(self, item: Any, completion_text: str, result: Any) -> float:
        time.sleep(3600)  # a C-level wait: no trio time limit reaches into a thread doing this
        return 1.0


@register("planted-raise")
class PlantedRaise(_Planted):
    name = "planted-raise"

    def score(self, item: Any, completion_text: str, result: Any) -> float:
        raise RuntimeError("planted scorer bug")


@register("planted-crash")
class PlantedCrash(_Planted):
    name = "planted-crash"

    def score(self, item: Any, completion_text: str, result: Any) -> float:
        os._exit(3)


UNJUDGED_REASON = "test.sh exited 1 and wrote no readable reward"


@register("planted-unjudged")
class PlantedUnjudged(_Planted):
    name = "planted-unjudged"

    def score(self, item: Any, completion_text: str, result: Any) -> float:
        raise VerifierFailed(UNJUDGED_REASON)


def setup() -> None:
    """The scorer workers' initializer: importing this module registered the domains."""
