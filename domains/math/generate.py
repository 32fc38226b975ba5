"""Write ``data/train.jsonl`` and ``data/eval.jsonl`` for the math domain, deterministically.

    python -m streamrl.domains.math.generate [--seed 7] [--train 1000] [--eval 64]

Kinds: fraction sums, linear equations, percentages, polynomial products (symbolic answer),
derivatives (symbolic), square-root simplification (symbolic), and three easy ones (a sum,
a half, a one-step equation) that give a small model some reward to start from (see
``calibration.json``). No prompt appears twice.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from fractions import Fraction
from math import isqrt
from pathlib import Path

from streamrl.domains import base
from streamrl.domains.base import unique_splits
from streamrl.domains.math.domain import DATA_DIR, MathItem

SEED = 7


def _signed(c: int, first: bool = False) -> str:
    if first:
        return str(c)
    return f"+ {c}" if c >= 0 else f"- {-c}"


def fraction_sum(rng: random.Random) -> tuple[str, str]:
    a = b = Fraction(1)
    while a.denominator == 1 or b.denominator == 1:
        a = Fraction(rng.randint(1, 9), rng.randint(2, 9))
        b = Fraction(rng.randint(1, 9), rng.randint(2, 9))
    return f"Compute {a} + {b} as a reduced fraction.", str(a + b)


def linear(rng: random.Random) -> tuple[str, str]:
    a, x, b = rng.randint(2, 9), rng.randint(-12, 12), rng.randint(-20, 20)
    return f"Solve for x: {a}x {_signed(b)} = {a * x + b}.", str(x)


def percent(rng: random.Random) -> tuple[str, str]:
    p, n = rng.choice([5, 10, 15, 20, 25, 30, 40, 50, 75]), rng.randint(2, 40) * 20
    return f"What is {p}% of {n}?", str(Fraction(p * n, 100))


def expand(rng: random.Random) -> tuple[str, str]:
    a, b = rng.choice([-1, 1]) * rng.randint(1, 9), rng.choice([-1, 1]) * rng.randint(1, 9)
    return (f"Expand (x {_signed(a)})(x {_signed(b)}).",
            f"x**2 + ({a + b})*x + ({a * b})")


def derivative(rng: random.Random) -> tuple[str, str]:
    a, b, k = rng.randint(1, 9), rng.randint(1, 9), rng.randint(2, 5)
    return (f"Differentiate {a}x^{k} + {b}x with respect to x.",
            f"{a * k}*x**{k - 1} + {b}")


def sqrt_simplify(rng: random.Random) -> tuple[str, str]:
    s, r = rng.randint(2, 9), rng.choice([2, 3, 5, 6, 7])
    n = s * s * r
    assert isqrt(n) ** 2 != n
    return f"Simplify sqrt({n}) to the form a*sqrt(b).", f"{s}*sqrt({r})"


def add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(2, 60), rng.randint(2, 40)
    return f"Compute {a} + {b}.", str(a + b)


def half(rng: random.Random) -> tuple[str, str]:
    n = 2 * rng.randint(2, 50)
    return f"What is half of {n}?", str(n // 2)


def one_step(rng: random.Random) -> tuple[str, str]:
    x, b = rng.randint(1, 20), rng.randint(1, 20)
    return f"Solve for x: x + {b} = {x + b}.", str(x)


KINDS: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "fraction_sum": fraction_sum, "linear": linear, "percent": percent, "expand": expand,
    "derivative": derivative, "sqrt": sqrt_simplify,
    # easy kinds (calibration.json): SmolLM2-135M scores 0 on every kind above
    "add": add, "half": half, "one_step": one_step,
}


def make_splits(seed: int = SEED, n_train: int = 1000, n_eval: int = 64
                ) -> dict[str, list[MathItem]]:
    rng = random.Random(seed)
    kinds = sorted(KINDS)

    def make_item(split: str, i: int) -> MathItem:
        kind = kinds[i % len(kinds)] if split == "eval" else rng.choice(kinds)
        prompt, answer = KINDS[kind](rng)
        return MathItem(id=f"math-{split}-{i:05d}", prompt=prompt, answer=answer, kind=kind)

    return unique_splits(make_item, n_eval, n_train)


def write_splits(splits: dict[str, list[MathItem]], data_dir: Path = DATA_DIR) -> None:
    base.write_splits(splits, data_dir)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--train", type=int, default=1000)
    ap.add_argument("--eval", type=int, default=64)
    args = ap.parse_args()
    write_splits(make_splits(args.seed, args.train, args.eval))


if __name__ == "__main__":
    main()
