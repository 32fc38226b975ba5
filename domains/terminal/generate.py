"""Write ``data/train.jsonl`` and ``data/eval.jsonl`` for the terminal domain, deterministically.

    python -m streamrl.domains.terminal.generate [--seed 11] [--train 240] [--eval 30]

Each task kind draws fresh files and parameters (so prompts differ) and writes its own hidden
check (a sh function body: success = exit 0), computed from the same parameters. A check
never trusts what the model could fake: it recomputes values from the staged data it
generated, runs model-written scripts on hidden inputs, and refuses links and fifos.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from pathlib import Path

from streamrl.domains import base
from streamrl.domains.base import unique_splits
from streamrl.domains.terminal.domain import DATA_DIR, TerminalItem

SEED = 11
WORDS = ("apple", "river", "stone", "cloud", "ember", "maple", "delta", "orbit", "pixel",
         "quartz", "tiger", "violet", "willow", "zephyr", "amber", "cedar", "falcon", "harbor")

Made = tuple[str, dict[str, str], str]  # (task text, files, check body)


def _regular(path: str) -> str:
    return f'[ -f "{path}" ] && [ ! -L "{path}" ]'


def _number_in(path: str, value: int) -> str:
    return f'{_regular(path)} && [ "$(head -c 100 "{path}" | tr -d " \\n\\r\\t")" = "{value}" ]'


OUTPUTS = ("answer.txt", "count.txt", "result.txt", "out.txt", "n.txt")


def count_matching(rng: random.Random) -> Made:
    word, out = rng.choice(WORDS), rng.choice(OUTPUTS)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 6)))
             for _ in range(rng.randint(15, 60))]
    if rng.random() < 0.5:
        how, n = "contain the word", sum(1 for line in lines if word in line.split())
    else:
        how, n = "start with the word", sum(1 for line in lines if line.split()[0] == word)
    task = f"Count the lines of data.txt that {how} {word!r} and write just that number to {out}."
    return task, {"data.txt": "\n".join(lines) + "\n"}, _number_in(out, n)


def sum_column(rng: random.Random) -> Made:
    rows = [(rng.choice(WORDS), rng.randint(1, 40), rng.randint(1, 99))
            for _ in range(rng.randint(4, 14))]
    column, out = rng.choice(("qty", "price")), rng.choice(OUTPUTS)
    src = rng.choice(("data.csv", "sales.csv", "items.csv", "stock.csv"))
    values = [r[1] if column == "qty" else r[2] for r in rows]
    what, value = rng.choice((("sum", sum(values)), ("largest value", max(values)),
                              ("smallest value", min(values))))
    csv = "name,qty,price\n" + "".join(f"{a},{b},{c}\n" for a, b, c in rows)
    task = f"Write the {what} of the {column} column of {src} (it has a header row) to {out}."
    return task, {src: csv}, _number_in(out, value)


_OPS: dict[str, tuple[Callable[[int, int], int], str]] = {
    "product": (lambda a, b: a * b, "$1 + $2"),
    "difference (first minus second)": (lambda a, b: a - b, "$2 - $1"),
    "sum": (lambda a, b: a + b, "$1 - $2"),
    "integer quotient (first divided by second)": (lambda a, b: a // b, "$1 * $2"),
}


def fix_script(rng: random.Random) -> Made:
    what = rng.choice(sorted(_OPS))
    fn, wrong = _OPS[what]
    name = rng.choice(("calc.sh", "compute.sh", "math.sh", "op.sh", "run.sh", "tool.sh"))
    script = f"#!/bin/sh\n# prints the {what} of its two arguments\necho $(({wrong}))\n"
    pairs = [(rng.randint(2, 30), rng.randint(2, 30)) for _ in range(3)]
    check = " && ".join(f'[ "$(timeout 3 sh {name} {a} {b})" = "{fn(a, b)}" ]' for a, b in pairs)
    task = (f"The script {name} should print the {what} of its two arguments, but it has a "
            f"bug. Fix {name} so that `sh {name} A B` prints the right number for any A and B.")
    return task, {name: script}, f"{_regular(name)} && {check}"


def rename_ext(rng: random.Random) -> Made:
    old, new = rng.choice((("jpeg", "jpg"), ("txt", "md"), ("htm", "html"), ("yml", "yaml"),
                           ("markdown", "md"), ("text", "txt"), ("tif", "tiff"), ("js", "mjs")))
    folder = rng.choice(("photos", "docs", "files", "assets", "inbox"))
    stems = rng.sample(WORDS, rng.randint(2, 5))
    files = {f"{folder}/{s}.{old}": f"{s} {rng.randint(0, 999)}\n" for s in stems}
    keep = f"{folder}/notes.cfg"
    files[keep] = "keep me\n"
    checks = [f'{_regular(f"{folder}/{s}.{new}")} && [ ! -e "{folder}/{s}.{old}" ] && '
              f'[ "$(cat "{folder}/{s}.{new}")" = "{files[f"{folder}/{s}.{old}"].strip()}" ]'
              for s in stems]
    checks.append(f'[ "$(cat "{keep}")" = "keep me" ]')
    task = (f"In the folder {folder}/, rename every file whose name ends in .{old} so that it "
            f"ends in .{new} instead (keep the rest of the name and the contents).")
    return task, files, " && ".join(checks)


def unique_sorted(rng: random.Random) -> Made:
    words = [rng.choice(WORDS[: rng.randint(5, len(WORDS))]) for _ in range(rng.randint(8, 25))]
    src = rng.choice(("words.txt", "names.txt", "list.txt", "tags.txt"))
    out = rng.choice(("sorted.txt", "unique.txt", "dedup.txt", "clean.txt", "final.txt"))
    reverse = rng.random() < 0.5
    expected = "\\n".join(sorted(set(words), reverse=reverse))
    order = "in reverse alphabetical order" if reverse else "alphabetically"
    task = f"Write the distinct words of {src}, sorted {order}, one per line, to {out}."
    check = f'{_regular(out)} && [ "$(cat {out})" = "$(printf \'{expected}\')" ]'
    return task, {src: "\n".join(words) + "\n"}, check


def move_errors(rng: random.Random) -> Made:
    names = rng.sample(WORDS, rng.randint(3, 6))
    bad = set(rng.sample(names, rng.randint(1, len(names) - 1)))
    marker = rng.choice(("ERROR", "WARNING", "FATAL"))
    src, dst = rng.choice(("logs", "journal", "reports")), rng.choice(("errors", "bad", "flagged"))
    files = {f"{src}/{n}.log": (f"{marker} disk full\n" if n in bad else "INFO all good\n")
             for n in names}
    checks = [f'{_regular(f"{dst}/{n}.log")} && [ ! -e "{src}/{n}.log" ]' if n in bad
              else f'{_regular(f"{src}/{n}.log")} && [ ! -e "{dst}/{n}.log" ]' for n in names]
    task = (f"Move every file in {src}/ that contains the word {marker} into a new folder "
            f"{dst}/ (leave the other files where they are).")
    return task, files, " && ".join(checks)


KINDS: dict[str, Callable[[random.Random], Made]] = {
    "count_matching": count_matching,
    "sum_column": sum_column,
    "fix_script": fix_script,
    "rename_ext": rename_ext,
    "unique_sorted": unique_sorted,
    "move_errors": move_errors,
}


def instruction(task: str, files: dict[str, str]) -> str:
    listing = ", ".join(sorted({f.split("/")[0] + ("/" if "/" in f else "") for f in files}))
    return (f"You are in a Linux shell (sh), in a directory that contains: {listing}.\n"
            f"Task: {task}\n"
            "Reply with exactly one shell command in a ```sh code block; you will then see its "
            "output. When the task is complete, reply with <done>.")


def make_item(rng: random.Random, split: str, index: int) -> TerminalItem:
    kind = rng.choice(sorted(KINDS))
    task, files, check = KINDS[kind](rng)
    return TerminalItem(id=f"terminal-{split}-{index:05d}", prompt=instruction(task, files),
                        kind=kind, files=files, check=check,
                        salt=f"{rng.getrandbits(128):032x}")


def make_splits(seed: int = SEED, n_train: int = 240, n_eval: int = 30
                ) -> dict[str, list[TerminalItem]]:
    rng = random.Random(seed)
    return unique_splits(lambda split, i: make_item(rng, split, i), n_eval, n_train)


def write_splits(splits: dict[str, list[TerminalItem]], data_dir: Path = DATA_DIR) -> None:
    base.write_splits(splits, data_dir)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--train", type=int, default=240)
    ap.add_argument("--eval", type=int, default=30)
    args = ap.parse_args()
    write_splits(make_splits(args.seed, args.train, args.eval))


if __name__ == "__main__":
    main()
