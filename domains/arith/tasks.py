"""The task kinds of the arith demo: "Write a Python program that prints <something>".

Each kind draws its numbers from an ``random.Random`` and returns the phrase that completes
the prompt and the exact expected stdout. Kinds range from one-operation arithmetic to tiny
loops and string handling, so a small model starts with some right and many wrong and
keeps improving over a run. Answers are integers or plain strings, never floats.
"""

from __future__ import annotations

import random
from collections.abc import Callable

Kind = Callable[[random.Random], tuple[str, str]]

WORDS = [
    "apple", "banana", "cherry", "orange", "mango", "lemon", "grape", "melon", "peach", "plum",
    "river", "mountain", "forest", "window", "garden", "rocket", "python", "turtle", "pencil",
    "silver", "yellow", "purple", "dragon", "castle", "bottle", "letter", "summer", "winter",
    "little", "button",
]


def _n(r: random.Random, lo: int = 10, hi: int = 99) -> int:
    return r.randint(lo, hi)


def add2(r: random.Random) -> tuple[str, str]:
    a, b = _n(r), _n(r)
    return f"the sum of {a} and {b}", str(a + b)


def sub2(r: random.Random) -> tuple[str, str]:
    a, b = _n(r), _n(r)
    return f"the result of {a} minus {b}", str(a - b)


def mul2(r: random.Random) -> tuple[str, str]:
    a, b = _n(r), _n(r, 2, 19)
    return f"the product of {a} and {b}", str(a * b)


def add3(r: random.Random) -> tuple[str, str]:
    a, b, c = _n(r), _n(r), _n(r)
    return f"the sum of {a}, {b} and {c}", str(a + b + c)


def mul_add(r: random.Random) -> tuple[str, str]:
    a, b, c = _n(r, 2, 20), _n(r, 2, 20), _n(r)
    return f"the value of {a} * {b} + {c}", str(a * b + c)


def floordiv(r: random.Random) -> tuple[str, str]:
    a, b = _n(r, 20, 200), _n(r, 2, 12)
    return f"the integer part of {a} divided by {b}", str(a // b)


def mod(r: random.Random) -> tuple[str, str]:
    a, b = _n(r, 20, 200), _n(r, 3, 12)
    return f"the remainder of {a} divided by {b}", str(a % b)


def square(r: random.Random) -> tuple[str, str]:
    a = _n(r, 11, 199)
    return f"the square of {a}", str(a * a)


def _list(r: random.Random) -> list[int]:
    return [_n(r, 1, 99) for _ in range(r.randint(4, 6))]


def list_sum(r: random.Random) -> tuple[str, str]:
    xs = _list(r)
    return f"the sum of the numbers in the list {xs}", str(sum(xs))


def list_max(r: random.Random) -> tuple[str, str]:
    xs = _list(r)
    return f"the largest number in the list {xs}", str(max(xs))


def list_min(r: random.Random) -> tuple[str, str]:
    xs = _list(r)
    return f"the smallest number in the list {xs}", str(min(xs))


def range_sum(r: random.Random) -> tuple[str, str]:
    n = _n(r, 10, 200)
    return f"the sum of all integers from 1 to {n} inclusive", str(n * (n + 1) // 2)


def even_sum(r: random.Random) -> tuple[str, str]:
    n = _n(r, 10, 100)
    return f"the sum of the even numbers from 1 to {n} inclusive", str(sum(range(2, n + 1, 2)))


def range_prod(r: random.Random) -> tuple[str, str]:
    a = r.randint(2, 12)
    b = a + r.randint(2, 5)
    prod = 1
    for i in range(a, b + 1):
        prod *= i
    return f"the product of all integers from {a} to {b} inclusive", str(prod)


def str_len(r: random.Random) -> tuple[str, str]:
    w = r.choice(WORDS) + r.choice(WORDS)
    return f"the number of characters in the string '{w}'", str(len(w))


def count_char(r: random.Random) -> tuple[str, str]:
    w = r.choice(WORDS)
    c = r.choice(sorted(set(w)))
    return f"how many times the letter '{c}' appears in the word '{w}'", str(w.count(c))


def reverse(r: random.Random) -> tuple[str, str]:
    w = r.choice(WORDS) + r.choice(WORDS)
    return f"the string '{w}' reversed", w[::-1]


KINDS: dict[str, Kind] = {
    k.__name__: k
    for k in (add2, sub2, mul2, add3, mul_add, floordiv, mod, square, list_sum, list_max,
              list_min, range_sum, even_sum, range_prod, str_len, count_char, reverse)
}
