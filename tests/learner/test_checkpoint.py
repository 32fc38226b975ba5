"""The learner's ledger: ordered, durable, and cut back to the weights that exist."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamrl.learner.checkpoint import LEDGER_FILE, Ledger, LedgerError, StepRecord


def test_ledger_roundtrip_and_void_lines_above_latest_version(tmp_path: Path) -> None:
    # Given a ledger with steps 1..3 where only weights up to v2 were completed
    ledger = Ledger.open(tmp_path, latest=0)
    for v, eps in [(1, ["a", "b"]), (2, ["c"]), (3, ["d", "e"])]:
        ledger.append(StepRecord(version=v, episode_ids=eps, entry_ids=[f"{v}-0"]))

    # When it is reopened at latest version 2
    reopened = Ledger.open(tmp_path, latest=2)

    # Then step 3 is void (its groups are still pending in Redis) and gone from the file
    assert reopened.consumed == {"a", "b", "c"}
    assert "d" not in reopened
    assert [r.version for r in reopened.records] == [1, 2]
    assert reopened.last() == StepRecord(version=2, episode_ids=["c"], entry_ids=["2-0"])
    assert len((tmp_path / LEDGER_FILE).read_text().splitlines()) == 2


def test_ledger_refuses_an_episode_twice_and_out_of_order_versions(tmp_path: Path) -> None:
    ledger = Ledger.open(tmp_path, latest=0)
    ledger.append(StepRecord(version=1, episode_ids=["a"]))
    with pytest.raises(LedgerError, match="trained twice"):
        ledger.append(StepRecord(version=2, episode_ids=["b", "a"]))
    with pytest.raises(LedgerError, match="trained twice"):
        ledger.append(StepRecord(version=2, episode_ids=["c", "c"]))
    with pytest.raises(LedgerError, match="ordered"):
        ledger.append(StepRecord(version=1, episode_ids=["d"]))
    assert Ledger.open(tmp_path, latest=9).consumed == {"a"}


def test_ledger_survives_a_torn_last_line_but_not_a_corrupt_middle(tmp_path: Path) -> None:
    ledger = Ledger.open(tmp_path, latest=0)
    ledger.append(StepRecord(version=1, episode_ids=["a"]))
    path = tmp_path / LEDGER_FILE
    good = path.read_bytes()

    # A crash during the append leaves half a line: dropped on open
    path.write_bytes(good + b'{"version": 2, "episo')
    assert [r.version for r in Ledger.open(tmp_path, latest=2).records] == [1]
    assert path.read_bytes() == good

    # Damage before the end is not a crash artefact: refuse to guess
    path.write_bytes(b"garbage\n" + good)
    with pytest.raises(LedgerError, match="corrupt"):
        Ledger.open(tmp_path, latest=2)
