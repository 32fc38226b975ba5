"""``scheduler.drop_overlong``: an item whose first prompt (the model's chat template applied)
plus the domain's max_new_tokens does not fit the model's positions could only fail in the
generator (retried, then dead-lettered). The scheduler drops such items from the train and
held-out sets, and says so per domain; a domain with no train item left is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from streamrl.actors.scheduler import Scheduler, eval_items
from streamrl.config.schema import Config, load_config
from streamrl.domains.declared import declare_domains
from streamrl.models import load_tokenizer, resolve_model
from streamrl.protocol import names as N
from streamrl.queues.client import RedisClient
from streamrl.runtime.context import ActorContext

LONG = "word " * 2500  # about 2,500 tokens: over the tiny model's 2,048 positions


def _config(tmp_path: Path, redis_url: str, run: str, rows: list[dict[str, str]],
            *sets: str) -> Config:  # fmt: skip
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    toml = tmp_path / "run.toml"
    toml.write_text(f'''
[run]
name = "{run}"
redis_url = "{redis_url}"
work_dir = "{tmp_path}"

[model]
spec = "tiny"

[scheduler]
domains = ["qa"]
max_new_tokens = 64

[domain.qa]
kind = "exact"
data = "{data}"
split = {{ by = "column", column = "part", train = "train", eval = "eval" }}
''')
    config = load_config(toml, list(sets))
    declare_domains(config.domain)  # as every process does on start (runtime.context)
    return config


def _rows() -> list[dict[str, str]]:
    rows = [{"id": f"t{i}", "prompt": f"Say {i}.", "answer": str(i), "part": "train"}
            for i in range(5)]  # fmt: skip
    rows += [{"id": "t-long", "prompt": LONG, "answer": "x", "part": "train"}]
    rows += [{"id": f"e{i}", "prompt": f"Repeat {i}.", "answer": str(i), "part": "eval"}
             for i in range(3)]  # fmt: skip
    rows += [{"id": "e-long", "prompt": LONG + "?", "answer": "x", "part": "eval"}]
    return rows


def test_the_tokens_of_the_long_prompt_are_over_the_model() -> None:
    tokenizer = load_tokenizer(resolve_model("tiny"))
    assert len(tokenizer(LONG)["input_ids"]) + 64 > 2048


async def test_overlong_items_are_dropped_and_logged(
    client: RedisClient, names: N.Names, redis_url: str, tmp_path: Path
) -> None:
    # Given a declared domain with one over-long train item and one over-long eval item
    config = _config(tmp_path, redis_url, names.run, _rows())
    # When the scheduler loads its items
    with capture_logs() as logs:
        scheduler = Scheduler(ActorContext(config, client, names))
        held_out = eval_items(config, "qa")
    # Then neither over-long item is among them, and the drop is logged per split
    assert sorted(it.id for it in scheduler.items["qa"]) == [f"t{i}" for i in range(5)]
    assert sorted(it.id for it in held_out) == ["e0", "e1", "e2"]
    dropped = [(e["items"], e["dropped"], e["kept"], e["positions"]) for e in logs
               if e["event"] == "items dropped: prompt + max_new_tokens over the model's positions"]
    assert sorted(dropped) == [("eval", 1, 3, 2048), ("train", 1, 5, 2048)]
    # And without the check (drop_overlong = false) they are kept
    kept = _config(tmp_path, redis_url, names.run, _rows(), "scheduler.drop_overlong=false")
    assert len(Scheduler(ActorContext(kept, client, names)).items["qa"]) == 6


async def test_a_domain_with_no_item_that_fits_is_refused(
    client: RedisClient, names: N.Names, redis_url: str, tmp_path: Path
) -> None:
    rows = [r for r in _rows() if r["id"].endswith("long") or r["part"] == "eval"]
    config = _config(tmp_path, redis_url, names.run, rows)
    with pytest.raises(ValueError, match="none of its 1 train items fits the model"):
        Scheduler(ActorContext(config, client, names))
