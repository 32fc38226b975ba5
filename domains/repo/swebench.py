"""SWE-bench-style instances whose repository snapshot is local, as ``repo_tests`` rows.

An instance (SWE-bench's JSON): ``instance_id``, ``repo`` ("owner/name"), ``base_commit``,
``problem_statement``, ``FAIL_TO_PASS`` and ``PASS_TO_PASS`` (JSON strings of lists of
pytest ids, or lists), ``test_patch`` (the diff that adds the hidden tests) and ``patch``
(the reference fix). The snapshot is ``<snapshots>/<instance_id>/``: a git checkout (its
files are read at ``base_commit``, whatever its work tree holds) or a plain directory (its
files as they are). Nothing is downloaded.

:func:`swebench_row` checks an instance against its snapshot (the commit exists, the test
patch applies exactly, every id's file is in the repository or the test patch) and gives
the row: ``tests`` = the files the test patch writes, ``repo_dir`` [+ ``base_commit``],
``solution`` = ``patch``. ``python -m streamrl.domains.repo.swebench INSTANCES SNAPSHOTS
OUT.jsonl`` writes them for a ``[domain.<name>] kind = "repo_tests"``. Raw instances load
as well, without converting: ``fields = { id = "instance_id", prompt = "problem_statement",
tests = "test_patch" }`` and ``[domain.<name>.verifier] snapshots = "<snapshots>"``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from streamrl.domains.kinds import Record
from streamrl.domains.kinds.repo_tests import RepoTests

REQUIRED = ("instance_id", "problem_statement", "FAIL_TO_PASS", "test_patch")


def read_instances(path: Path) -> list[dict[str, Any]]:
    """The instances of a ``.json`` file (a list, or one instance) or a ``.jsonl`` file."""
    text = Path(path).read_text()
    if Path(path).suffix == ".jsonl":
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        loaded = json.loads(text)
        rows = loaded if isinstance(loaded, list) else [loaded]
    for i, row in enumerate(rows):
        missing = [k for k in REQUIRED if not isinstance(row, dict) or k not in row]
        if missing:
            raise ValueError(f"{path}: instance {i}: no {', '.join(missing)}")
    return rows


def swebench_row(instance: dict[str, Any], snapshots: Path,
                 verifier: RepoTests | None = None) -> dict[str, Any]:
    """The ``repo_tests`` row of ``instance``, its snapshot in ``snapshots``; ValueError
    naming the instance when the snapshot does not fit it."""
    iid = str(instance["instance_id"])
    snapshot = Path(snapshots) / iid
    if not snapshot.is_dir():
        raise ValueError(f"instance {iid!r}: no snapshot directory {snapshot}")
    v = verifier or RepoTests()
    raw = Record(id=iid, prompt=str(instance["problem_statement"]),
                 tests=str(instance["test_patch"]),
                 extra={k: val for k, val in instance.items()
                        if k not in ("instance_id", "problem_statement", "test_patch")}
                 | {"repo_dir": str(snapshot)})
    source = v.source(raw)
    f2p, p2p = v.ids(raw)
    v.check_item(raw)  # the commit, the test patch, the ids' files
    hidden = v.hidden(raw, v.repository(raw))
    try:
        tests = {p: d.decode() for p, d in hidden.items()}
    except UnicodeDecodeError:
        raise ValueError(f"instance {iid!r}: the test patch writes a binary file") from None
    row = {
        "id": iid, "prompt": raw.prompt, "problem_statement": raw.prompt, "tests": tests,
        "FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p, "repo_dir": str(snapshot.resolve()),
        "solution": str(instance.get("patch") or ""), "repo_name": str(instance.get("repo", "")),
    }
    if source.get("base_commit"):
        row["base_commit"] = source["base_commit"]
    for key in ("image", "version", "environment_setup_commit", "hints_text"):
        if instance.get(key):
            row[key] = instance[key]
    return row


def swebench_rows(path: Path, snapshots: Path) -> list[dict[str, Any]]:
    return [swebench_row(instance, snapshots) for instance in read_instances(path)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("instances", type=Path)
    parser.add_argument("snapshots", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    rows = swebench_rows(args.instances, args.snapshots)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} instances -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
