"""A generated set of repository tasks: small Python repositories with one seeded bug each.

Four templates (:mod:`.templates`: string helpers, an interval / date calculator, a stack and
ring queue, a parser), each with seeded bugs (off by one, a wrong operator, a missing edge
case). An instance is a template, one of its bugs, a package name and a phrasing of the
issue: the repository holds the buggy module, a README and the tests that still pass (the
visible suite); the hidden test file adds the tests that expose the bug (``FAIL_TO_PASS``);
the visible tests are ``PASS_TO_PASS``; ``solution`` is the reference fix as a diff.

Guarantees: deterministic from the seed; the held-out split (``eval``) uses bugs that no
training instance has (one per template, drawn by the seed), so no eval prompt, bug or fix
is seen in training; every instance can be checked (:func:`check_rows`): the buggy
repository fails every ``FAIL_TO_PASS`` test and passes every ``PASS_TO_PASS`` one, the
reference fix passes all.

``python -m streamrl.domains.repo.generate OUT [--seed S] [--train N] [--eval N] [--check]``
writes ``OUT/train.jsonl`` and ``OUT/eval.jsonl``, rows for a declared domain::

    [domain.repo]
    kind = "repo_tests"
    data = "OUT"
    split = { by = "files", train = "train.jsonl", eval = "eval.jsonl" }
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from streamrl.domains.kinds import Record
from streamrl.domains.kinds.repo_tests import FINAL, RepoTests
from streamrl.domains.repo.files import make_diff
from streamrl.domains.repo.templates import TEMPLATES, Bug, Template
from streamrl.sandbox.base import ExecRequest, ExecResult

INSTRUCTIONS = ("Fix the issue with the smallest change to the code (not to the tests). Reply "
                "with a unified diff of your change (--- a/path, +++ b/path, @@ hunks with "
                "exact context lines) in one ```diff block.")


def _names(source: str) -> list[str]:
    tree = ast.parse(source)
    return [n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)]


def _test_file(t: Template, pkg: str, tests: Iterable[tuple[str, str, tuple[str, ...]]]) -> str:
    stem = t.module.removesuffix(".py")
    head = f"import pytest\n\nfrom {pkg}.{stem} import {', '.join(_names(t.source))}\n"
    return head + "".join(f"\n\ndef {name}():\n    {body}\n" for name, body, _ in tests)


def instance(t: Template, bug: Bug, pkg: str, phrasing: int) -> dict[str, Any]:
    """One task as a row of the ``repo_tests`` kind."""
    if t.source.count(bug.find) != 1:
        raise ValueError(f"{t.name}/{bug.name}: the bug's text is not in the module once")
    stem = t.module.removesuffix(".py")
    module, tests_path = f"{pkg}/{t.module}", f"tests/test_{stem}.py"
    fixed = t.source.replace("{pkg}", pkg)
    buggy = fixed.replace(bug.find, bug.replace)
    visible = [x for x in t.tests if bug.name not in x[2]]
    exposing = [x for x in t.tests if bug.name in x[2]]
    if not exposing:
        raise ValueError(f"{t.name}/{bug.name}: no test exposes the bug")
    repo = {
        "README.md": f"# {pkg}\n\n{t.readme}\n\nRun the tests with `python3 -m pytest`.\n",
        f"{pkg}/__init__.py": f'"""{pkg}: {t.readme}"""\n',
        module: buggy,
        tests_path: _test_file(t, pkg, visible),
    }
    statement = bug.statements[phrasing % len(bug.statements)].replace("{pkg}", pkg)
    files = "".join(f"### {path}\n```{'python' if path.endswith('.py') else ''}\n{text}```\n\n"
                    for path, text in repo.items())
    fix = make_diff({module: buggy.encode()}, {module: fixed.encode()})
    return {
        "id": f"{t.name}-{bug.name}-{pkg}-{phrasing}",
        "prompt": f"The repository `{pkg}`:\n\n{files}Issue:\n{statement}\n\n{INSTRUCTIONS}",
        "problem_statement": statement,
        "repo": repo,
        "tests": {tests_path: _test_file(t, pkg, [*visible, *exposing])},
        "FAIL_TO_PASS": [f"{tests_path}::{name}" for name, _, _ in exposing],
        "PASS_TO_PASS": [f"{tests_path}::{name}" for name, _, _ in visible],
        "solution": fix,
        "template": t.name, "bug": bug.name, "bug_kind": bug.kind,
    }


def generate(seed: int = 0, n_train: int = 48, n_eval: int = 16) -> dict[str, list[dict[str, Any]]]:
    """``{"train": rows, "eval": rows}``: eval from one held-out bug per template."""
    rng = random.Random(seed)
    held = {t.name: rng.choice(t.bugs).name for t in TEMPLATES}
    pools: dict[str, list[tuple[Template, Bug, str, int]]] = {"train": [], "eval": []}
    for t in TEMPLATES:
        for bug in t.bugs:
            split = "eval" if held[t.name] == bug.name else "train"
            pools[split] += [(t, bug, pkg, k) for pkg in t.packages
                             for k in range(len(bug.statements))]
    out = {}
    for split, n in (("train", n_train), ("eval", n_eval)):
        pool = pools[split]
        rng.shuffle(pool)
        # round-robin over templates so a small set still covers each of them
        by_template = {t.name: [p for p in pool if p[0] is t] for t in TEMPLATES}
        picked: list[tuple[Template, Bug, str, int]] = []
        while len(picked) < min(n, len(pool)):
            for chosen in by_template.values():
                if chosen and len(picked) < n:
                    picked.append(chosen.pop())
        out[split] = [instance(*p) for p in picked]
    return out


def record(row: dict[str, Any]) -> Record:
    """A row as the item a declared domain of kind ``repo_tests`` loads (default fields)."""
    extra = {k: v for k, v in row.items() if k not in ("id", "prompt", "tests")}
    return Record(id=row["id"], prompt=row["prompt"], tests=row["tests"], extra=extra)


def write_dataset(out: Path, seed: int = 0, n_train: int = 48, n_eval: int = 16) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for split, rows in generate(seed, n_train, n_eval).items():
        (out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


# -- the check --------------------------------------------------------------------------

Runner = Callable[[ExecRequest], ExecResult]


def run_local(request: ExecRequest, python: str = sys.executable) -> ExecResult:
    """Run a request of TRUSTED code (the generated repositories, the reference fixes) in a
    temporary directory with ``python`` for ``python3``: no sandbox. For checks only."""
    with tempfile.TemporaryDirectory(prefix="repo-check-") as work:
        for rel, data in request.files.items():
            path = Path(work) / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        argv = [python if a == "python3" else a for a in request.argv]
        start = time.monotonic()
        try:
            proc = subprocess.run(argv, input=request.stdin, capture_output=True, cwd=work,
                                  timeout=request.limits.timeout_s, check=False)
        except subprocess.TimeoutExpired:
            return ExecResult(None, b"", b"", True, False, time.monotonic() - start)
        return ExecResult(proc.returncode, proc.stdout, proc.stderr, False, False,
                          time.monotonic() - start)


def check_row(row: dict[str, Any], run: Runner = run_local,
              verifier: RepoTests | None = None) -> list[str]:
    """What is wrong with one instance ([]: nothing): the buggy repository must fail every
    FAIL_TO_PASS test and pass every PASS_TO_PASS one; the reference fix must pass all."""
    v = verifier or RepoTests(test_timeout_s=60.0)
    item = record(row)
    v.check_item(item)
    problems = []
    base = v.repository(item)
    buggy = {r.name: r.status for r in v.test_results(item, FINAL, run(v.judge(item, base)))}
    for t in row["FAIL_TO_PASS"]:
        if buggy.get(t) in ("pass", None):
            problems.append(f"{row['id']}: {t} does not fail on the buggy repository "
                            f"({buggy.get(t)})")
    for t in row["PASS_TO_PASS"]:
        if buggy.get(t) != "pass":
            problems.append(f"{row['id']}: {t} does not pass on the buggy repository "
                            f"({buggy.get(t)})")
    completion = f"```diff\n{row['solution']}```"
    request = v.exec_request(item, completion)
    if request is None:
        return [*problems, f"{row['id']}: the reference fix does not apply"]
    result = run(request)
    if v.score(item, completion, result) != 1.0:
        fixed = {r.name: r.status for r in v.test_results(item, completion, result)}
        problems.append(f"{row['id']}: the reference fix does not pass all: {fixed}")
    return problems


def check_rows(rows: list[dict[str, Any]], run: Runner = run_local,
               workers: int = 2) -> list[str]:
    with ThreadPoolExecutor(workers) as pool:
        return [p for found in pool.map(lambda r: check_row(r, run), rows) for p in found]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train", type=int, default=48)
    parser.add_argument("--eval", type=int, default=16)
    parser.add_argument("--check", action="store_true",
                        help="run every instance's buggy repository and reference fix")
    args = parser.parse_args(argv)
    write_dataset(args.out, args.seed, args.train, args.eval)
    if args.check:
        rows = [json.loads(line) for split in ("train", "eval")
                for line in (args.out / f"{split}.jsonl").read_text().splitlines()]
        problems = check_rows(rows)
        print("\n".join(problems) or f"{len(rows)} instances checked: all as expected")
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
