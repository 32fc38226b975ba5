"""Write ``data/train.jsonl`` and ``data/eval.jsonl`` for the code domain, deterministically.

    python -m streamrl.domains.code.generate [--seed 5] [--train 400] [--eval 40]

Each problem is a template with parameters (so prompts differ), a reference solution that
computes the hidden tests' expected values, and one worked example shown in the prompt.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from streamrl.domains import base
from streamrl.domains.base import unique_splits
from streamrl.domains.code.domain import DATA_DIR, Case, CodeItem

SEED = 5
N_TESTS = 5

Problem = tuple[str, str, Callable[..., Any], Callable[[random.Random], list[Any]]]


def _ints(rng: random.Random, n: int = 6) -> list[int]:
    return [rng.randint(-20, 20) for _ in range(rng.randint(0, n))]


def _word(rng: random.Random) -> str:
    return "".join(rng.choice("abcdeiou") for _ in range(rng.randint(0, 9)))


def problems(rng: random.Random) -> list[Problem]:
    """(name, description, reference, argument generator) with fresh parameters."""
    k, m = rng.randint(2, 9), rng.randint(2, 7)
    return [
        (f"add_{k}", f"returns a new list with {k} added to every element of the list `xs`",
         lambda xs: [x + k for x in xs], lambda r: [_ints(r)]),
        (f"count_multiples_of_{m}", f"returns how many integers in the list `xs` are "
         f"divisible by {m}", lambda xs: sum(1 for x in xs if x % m == 0), lambda r: [_ints(r)]),
        (f"repeat_{k}", f"returns the string `s` repeated {k} times",
         lambda s: s * k, lambda r: [_word(r)]),
        ("count_vowels", "returns the number of vowels (a, e, i, o, u) in the string `s`",
         lambda s: sum(c in "aeiou" for c in s), lambda r: [_word(r)]),
        (f"clip_{k}", f"returns the list `xs` with every element larger than {k} replaced "
         f"by {k}", lambda xs: [min(x, k) for x in xs], lambda r: [_ints(r)]),
        (f"sum_below_{k * 5}", f"returns the sum of the integers from 0 up to but not "
         f"including `n` that are divisible by {m} (n < {k * 5})",
         lambda n: sum(i for i in range(n) if i % m == 0), lambda r: [r.randint(0, k * 5 - 1)]),
        ("is_palindrome", "returns True if the string `s` reads the same backwards, "
         "else False", lambda s: s == s[::-1], lambda r: [r.choice([_word(r), "abba", "ada"])]),
        (f"pairs_summing_to_{k}", f"returns the number of pairs (i, j) with i < j of indices of "
         f"the list `xs` such that xs[i] + xs[j] == {k}", lambda xs: sum(1 for i in range(len(xs))
                                                for j in range(i + 1, len(xs))
                                                if xs[i] + xs[j] == k),
         lambda r: [[r.randint(-3, k + 3) for _ in range(r.randint(0, 7))]]),
    ]


def make_item(rng: random.Random, split: str, index: int) -> CodeItem:
    name, description, reference, gen_args = rng.choice(problems(rng))
    example = gen_args(rng)
    while not example or example == [[]] or example == [""]:
        example = gen_args(rng)
    params = description.split("`")[1]  # the first quoted name is the argument
    prompt = (f"Write a Python function `{name}({params})` that {description}. "
              f"For example, {name}({', '.join(map(repr, example))}) == "
              f"{reference(*example)!r}. Reply with the code in one ```python block.")
    tests: list[Case] = []
    while len(tests) < N_TESTS:
        args = gen_args(rng)
        tests.append(Case(args=args, expected=reference(*args)))
    return CodeItem(id=f"code-{split}-{index:05d}", prompt=prompt, entry=name, tests=tests,
                    salt=f"{rng.getrandbits(128):032x}")


def make_splits(seed: int = SEED, n_train: int = 400, n_eval: int = 40
                ) -> dict[str, list[CodeItem]]:
    rng = random.Random(seed)
    return unique_splits(lambda split, i: make_item(rng, split, i), n_eval, n_train)


def write_splits(splits: dict[str, list[CodeItem]], data_dir: Path = DATA_DIR) -> None:
    base.write_splits(splits, data_dir)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--train", type=int, default=400)
    ap.add_argument("--eval", type=int, default=40)
    args = ap.parse_args()
    write_splits(make_splits(args.seed, args.train, args.eval))


if __name__ == "__main__":
    main()
