"""Write ``data/train.jsonl`` and ``data/eval.jsonl`` for the arith demo, deterministically.

    python -m streamrl.domains.arith.generate [--seed 1234] [--train 2000] [--eval 64]

The eval split cycles through the task kinds (a balanced held-out mix); the train split
draws kinds uniformly. No prompt appears twice, in or across splits.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from streamrl.domains.arith.domain import DATA_DIR, ArithItem, prompt_for
from streamrl.domains.arith.tasks import KINDS

SEED = 1234


def make_splits(seed: int = SEED, n_train: int = 2000, n_eval: int = 64
                ) -> dict[str, list[ArithItem]]:
    rng = random.Random(seed)
    seen: set[str] = set()
    kinds = sorted(KINDS)

    def draw(split: str, kind: str, index: int) -> ArithItem | None:
        for _ in range(200):
            phrase, answer = KINDS[kind](rng)
            prompt = prompt_for(phrase)
            if prompt not in seen:
                seen.add(prompt)
                return ArithItem(id=f"arith-{split}-{index:05d}", prompt=prompt, answer=answer,
                                 kind=kind)
        return None  # this kind has (nearly) no unused prompts left

    def draw_any(split: str, first: str, index: int) -> ArithItem:
        for kind in [first, *rng.sample(kinds, len(kinds))]:
            item = draw(split, kind, index)
            if item is not None:
                return item
        raise RuntimeError("every task kind ran out of distinct prompts")

    eval_items = [draw_any("eval", kinds[i % len(kinds)], i) for i in range(n_eval)]
    train_items = [draw_any("train", rng.choice(kinds), i) for i in range(n_train)]
    return {"train": train_items, "eval": eval_items}


def write_splits(splits: dict[str, list[ArithItem]], out: Path = DATA_DIR) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for split, items in splits.items():
        lines = [json.dumps({"id": it.id, "prompt": it.prompt, "answer": it.answer,
                             "kind": it.kind}) for it in items]
        (out / f"{split}.jsonl").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--train", type=int, default=2000)
    ap.add_argument("--eval", type=int, default=64)
    ap.add_argument("--out", type=Path, default=DATA_DIR)
    args = ap.parse_args()
    splits = make_splits(args.seed, args.train, args.eval)
    write_splits(splits, args.out)
    print({k: len(v) for k, v in splits.items()}, "->", args.out)


if __name__ == "__main__":
    main()
