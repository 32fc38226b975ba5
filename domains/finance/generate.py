"""Write ``data/train.jsonl`` and ``data/eval.jsonl`` for the finance domain, deterministically.

    python -m streamrl.domains.finance.generate [--seed 11] [--train 600] [--eval 48]
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from streamrl.domains import base
from streamrl.domains.base import unique_splits
from streamrl.domains.finance.domain import DATA_DIR, FinanceItem, Row

SEED = 11
SEGMENTS = ("Retail", "Cloud", "Ads", "Devices", "Services", "Licensing", "Payments", "Games")
FORMAT = ('Answer with one JSON object of this form, with numbers in place of ...: '
          '{{"parts": {{{parts}}}, "total": ..., "ratio": ...}} (ratio as a decimal, 3 places).')


def table(rows: list[Row]) -> str:
    lines = ["| segment | revenue | cost |", "|---|---|---|"]
    lines += [f"| {r.segment} | {r.revenue} | {r.cost} |" for r in rows]
    return "\n".join(lines)


def make_item(rng: random.Random, split: str, index: int) -> FinanceItem:
    names = rng.sample(SEGMENTS, rng.randint(2, 4))
    rows = []
    for name in names:
        revenue = rng.randint(10, 500) * 10
        rows.append(Row(name, revenue, rng.randint(revenue // 40, revenue // 10) * 10 // 1))
    kind = rng.choice(["share", "margin"])
    target = rng.choice(names) if kind == "share" else ""
    if kind == "share":
        question = (f"List each segment's revenue (parts), the total revenue (total), and "
                    f"{target}'s share of total revenue (ratio).")
    else:
        question = ("List each segment's profit = revenue - cost (parts), the total profit "
                    "(total), and the profit margin = total profit / total revenue (ratio).")
    parts = ", ".join(f'"{name}": ...' for name in names)
    prompt = f"Figures in USD thousands.\n{table(rows)}\n\n{question}\n" + FORMAT.format(
        parts=parts)
    return FinanceItem(id=f"finance-{split}-{index:05d}", prompt=prompt, rows=rows, kind=kind,
                       target=target)


def make_splits(seed: int = SEED, n_train: int = 600, n_eval: int = 48
                ) -> dict[str, list[FinanceItem]]:
    rng = random.Random(seed)
    return unique_splits(lambda split, i: make_item(rng, split, i), n_eval, n_train)


def write_splits(splits: dict[str, list[FinanceItem]], data_dir: Path = DATA_DIR) -> None:
    base.write_splits(splits, data_dir)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--train", type=int, default=600)
    ap.add_argument("--eval", type=int, default=48)
    args = ap.parse_args()
    write_splits(make_splits(args.seed, args.train, args.eval))


if __name__ == "__main__":
    main()
