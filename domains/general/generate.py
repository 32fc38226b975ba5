"""Write ``data/eval.jsonl`` for the general domain (eval only: no training split).

    python -m streamrl.domains.general.generate [--seed 3] [--eval 48]

Kinds cycle in a fixed order so every kind is in the first items of the split.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable

from streamrl.domains.base import write_jsonl
from streamrl.domains.general.domain import DATA_DIR, GeneralItem

SEED = 3
CAPITALS = {
    "France": "Paris", "Japan": "Tokyo", "Italy": "Rome", "Germany": "Berlin",
    "Spain": "Madrid", "Egypt": "Cairo", "Canada": "Ottawa", "Russia": "Moscow",
    "China": "Beijing", "Greece": "Athens", "Portugal": "Lisbon", "Kenya": "Nairobi",
    "Norway": "Oslo", "Peru": "Lima", "Poland": "Warsaw", "Ireland": "Dublin",
}  # fmt: skip
OPPOSITES = {
    "hot": "cold", "up": "down", "big": "small", "day": "night", "fast": "slow",
    "open": "closed", "left": "right", "old": "new", "early": "late", "full": "empty",
}  # fmt: skip
WORDS = ["apple", "river", "stone", "garden", "pencil", "window", "tiger", "cloud",
         "bread", "lamp", "orange", "forest", "candle", "mirror", "rocket", "violin"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
NUMBERS = ["one", "two", "three", "four", "five"]

Make = Callable[[random.Random], tuple[str, str]]


def capital(r: random.Random) -> tuple[str, str]:
    country = r.choice(sorted(CAPITALS))
    return f"What is the capital of {country}?", CAPITALS[country]


def opposite(r: random.Random) -> tuple[str, str]:
    word = r.choice(sorted(OPPOSITES))
    return f"What is the opposite of the word '{word}'?", OPPOSITES[word]


def upper(r: random.Random) -> tuple[str, str]:
    word = r.choice(WORDS)
    return f"Write the word '{word}' in capital letters.", word.upper()


def reverse(r: random.Random) -> tuple[str, str]:
    word = r.choice(WORDS)
    return f"Write the letters of the word '{word}' in reverse order.", word[::-1]


def repeat(r: random.Random) -> tuple[str, str]:
    word, n = r.choice(WORDS), r.randint(2, 4)
    return (f"Write the word '{word}' {NUMBERS[n - 1]} times, separated by spaces.",
            " ".join([word] * n))


def sort_words(r: random.Random) -> tuple[str, str]:
    words = r.sample(WORDS, 3)
    return (f"Sort these words alphabetically: {', '.join(words)}. Write them separated "
            f"by commas.", ", ".join(sorted(words)))


def next_day(r: random.Random) -> tuple[str, str]:
    i = r.randrange(7)
    return f"Which day of the week comes after {DAYS[i]}?", DAYS[(i + 1) % 7]


def add(r: random.Random) -> tuple[str, str]:
    a, b = r.randint(2, 30), r.randint(2, 30)
    return f"What is {a} + {b}?", str(a + b)


def larger(r: random.Random) -> tuple[str, str]:
    a, b = r.sample(range(10, 100), 2)
    return f"Which number is larger, {a} or {b}?", str(max(a, b))


def count_words(r: random.Random) -> tuple[str, str]:
    words = r.sample(WORDS, r.randint(2, 6))
    return f"How many words are in this list: {' '.join(words)}?", str(len(words))


KINDS: dict[str, Make] = {f.__name__: f for f in (
    capital, opposite, upper, reverse, repeat, sort_words, next_day, add, larger, count_words)}


def make_eval(seed: int = SEED, n: int = 48) -> list[GeneralItem]:
    rng = random.Random(seed)
    kinds = list(KINDS)
    items: list[GeneralItem] = []
    seen: set[str] = set()
    i = 0
    while len(items) < n:
        kind = kinds[i % len(kinds)]
        i += 1
        prompt, answer = KINDS[kind](rng)
        if prompt in seen:
            continue
        seen.add(prompt)
        items.append(GeneralItem(id=f"general-eval-{len(items):05d}", prompt=prompt,
                                 answer=answer, kind=kind))
    return items


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--eval", type=int, default=48)
    args = ap.parse_args()
    write_jsonl(make_eval(args.seed, args.eval), DATA_DIR / "eval.jsonl")


if __name__ == "__main__":
    main()
