"""Declared domains through the real pipeline: a JSONL file, a Parquet file and a Hugging
Face ``datasets`` DatasetDict saved to disk, written to a temporary directory, declared as
three domains in TOML (a text kind, a numeric kind with its options, and the ``math`` plugin
over the user's rows) and run by ``streamrl up`` with the tiny model. Every actor process
builds the same domains from the config; each domain's groups reach the learner and are
trained, and its held-out items are evaluated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

from streamrl.protocol import names as N
from streamrl.protocol.messages import Trajectory
from streamrl.queues.codec import decode
from tests.up_run import run_up

REPO = Path(__file__).resolve().parents[1]
DOMAINS = ("qa-jsonl", "num-parquet", "math-datasets")


def _write_data(data: Path) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    data.mkdir()
    words = ["red", "blue", "green", "cat", "dog", "sun", "tree", "fish", "bird", "rain"]
    (data / "qa.jsonl").write_text("".join(
        json.dumps({"qid": f"w{i}", "question": f"Repeat the word: {w}", "gold": w}) + "\n"
        for i, w in enumerate(words * 3)))
    pq.write_table(pa.Table.from_pylist([
        {"prompt": f"What is {a} plus {b}?", "answer": float(a + b),
         "part": "test" if a % 5 == 0 else "train"}
        for a in range(1, 21) for b in (1, 2)]), data / "num.parquet")
    rows = [{"problem": f"What is {a} + {a}?", "answer": str(2 * a), "kind": "add",
             "id": f"m{a}"} for a in range(1, 31)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:22]),
                          "validation": datasets.Dataset.from_list(rows[22:])}
                         ).save_to_disk(str(data / "ds"))


def _config(tmp_path: Path) -> Path:
    data = tmp_path / "data"
    _write_data(data)
    base = (REPO / "configs" / "tiny.toml").read_text()
    assert 'domains = ["arith"]' in base
    text = base.replace('domains = ["arith"]', f"domains = {json.dumps(list(DOMAINS))}")
    text = text.replace("groups_per_step = 2", "groups_per_step = 3")
    text += f'''
[domain.qa-jsonl]
kind = "exact"
data = "{data / 'qa.jsonl'}"
fields = {{ prompt = "question", answer = "gold", id = "qid" }}
prompt = {{ system = "Reply with one word.", template = "Q: {{prompt}}" }}
split = {{ by = "hash", eval_fraction = 0.25 }}

[domain.num-parquet]
kind = "numeric"
data = "{data / 'num.parquet'}"
split = {{ by = "column", column = "part", train = "train", eval = "test" }}

[domain.num-parquet.verifier]
abs_tol = 0.5

[domain.math-datasets]
kind = "math"
data = "{data / 'ds'}"
fields = {{ prompt = "problem" }}
split = {{ by = "files", train = "train", eval = "validation" }}
'''
    path = tmp_path / "declared.toml"
    path.write_text(text)
    return path


@pytest.mark.system
def test_three_declared_domains_train_through_the_real_actors(
    redis_url: str, tmp_path: Path
) -> None:
    # Given three data sets on disk, declared as domains in TOML
    config = _config(tmp_path)
    # When the real CLI runs four learner steps over them
    done = run_up(redis_url, tmp_path, {"learner.max_steps": "4", "learner.max_staleness": "4"},
                  prefix="decl", config=str(config), max_minutes=8, timeout_s=720)
    run, summary = done.run, done.summary
    assert summary["steps"] >= 4 and summary["dead_letters"] == 0

    # Then every domain's groups were trained: each trajectory the learner acknowledged
    # (delivered, not pending) was trained, since none was dropped as stale
    r = redis.Redis.from_url(redis_url)
    names = N.Names(run)
    assert int(r.get(names.counter("dropped_stale")) or 0) == 0
    stream = names.stream(N.TRAJECTORIES)
    group = {g["name"].decode(): g for g in r.xinfo_groups(stream)}[
        N.GROUP_OF_STREAM[N.TRAJECTORIES]]
    last = group["last-delivered-id"].decode()
    pending = {p["message_id"].decode() for p in r.xpending_range(
        stream, N.GROUP_OF_STREAM[N.TRAJECTORIES], "-", "+", 100)}
    trained: dict[str, int] = {}
    for entry_id, fields in r.xrange(stream, "-", last):
        if entry_id.decode() not in pending:
            domain = decode(fields[b"d"], Trajectory).rollout.task.domain
            trained[domain] = trained.get(domain, 0) + 1
    assert set(trained) == set(DOMAINS), trained
    assert sum(trained.values()) >= 4 * 3  # four steps of three groups
    # and each one's held-out items were evaluated (item ids from its own data)
    evals = [decode(f[b"d"], Trajectory).rollout.task for _, f in
             r.xrange(names.stream(N.EVALS))]
    held_out = {d: {t.item_id for t in evals if t.domain == d} for d in DOMAINS}
    assert held_out["num-parquet"] and all(
        t.spec["prompt"].startswith(("What is 5 ", "What is 10 ", "What is 15 ", "What is 20 "))
        for t in evals if t.domain == "num-parquet")
    assert held_out["math-datasets"] == {f"m{a}" for a in range(23, 31)}
    assert held_out["qa-jsonl"] and held_out["qa-jsonl"] <= {f"w{i}" for i in range(30)}
