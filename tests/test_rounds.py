"""Post-training rounds without a run: the sequence's config as it loads, the gates on
hand-made held-out results, and the start checkpoint kept and published again
(config/rounds.py, cli/rounds.py). The runs themselves: tests/test_rounds_up.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from streamrl.cli.rounds import RoundsState, StageRecord, judge, keep_start, restore, rounds_text
from streamrl.config.rounds import stage_config
from streamrl.config.schema import ConfigError, StageConfig, load_config

BASE = """
[scheduler]
domains = ["arith"]
eval_domains = ["general"]
"""


def _load(tmp_path: Path, stages: str, *overrides: str):  # type: ignore[no-untyped-def]
    path = tmp_path / "rounds.toml"
    path.write_text(BASE + stages)
    return load_config(path, list(overrides))


def test_a_sequence_loads_and_each_stage_gets_its_overrides(tmp_path: Path) -> None:
    config = _load(tmp_path, """
[[rounds.stage]]
name = "sft"
steps = 2
overrides = { "learner.mode" = "sft", "learner.sft.data" = "d.jsonl", "learner.lr" = 1e-3 }
[[rounds.stage]]
minutes = 1.5
overrides = { "scheduler.domains" = ["arith", "math"] }
keep = ["general"]
reach = { math = 0.25 }
""")
    first = stage_config(config, 0, max_steps=7)
    second = stage_config(config, 1)
    assert (first.learner.mode, first.learner.lr, first.learner.max_steps) == ("sft", 1e-3, 7)
    assert first.rounds.stage == [] and config.learner.mode == "rl"
    assert second.scheduler.domains == ["arith", "math"] and second.learner.mode == "rl"


@pytest.mark.parametrize(("stages", "error"), [
    ('[[rounds.stage]]\nsteps = 1\noverrides = { "learner.lrr" = 1 }',
     "rounds.stage[0] (stage0): override 'learner.lrr': no such setting"),
    ('[[rounds.stage]]\nsteps = 1\noverrides = { "learnr.lr" = 1 }',
     "override 'learnr.lr': no such setting"),
    ('[[rounds.stage]]\nsteps = 1\noverrides = { "run.name" = "other" }',
     "override 'run.name': run.* is the run's"),
    ('[[rounds.stage]]\nsteps = 1\noverrides = { "learner.lr" = -1.0 }',
     "rounds.stage[0] (stage0): overrides: Expected `float` > 0.0 - at `$.learner.lr`"),
    ('[[rounds.stage]]\nname = "a"\noverrides = { "learner.lr" = 1e-3 }',
     "rounds.stage[0] (a): no budget"),
    ('[[rounds.stage]]\nsteps = -1', "Expected `int` >= 0"),
    ('[[rounds.stage]]\nsteps = 1\nkeep = ["math"]',
     "gate domain 'math' is not evaluated in this stage"),
    ('[[rounds.stage]]\nsteps = 1\nreach = { code = 0.5 }', "gate domain 'code'"),
    ('[[rounds.stage]]\nsteps = 1\nreach = { arith = 1.5 }', "a held-out reward is in [0, 1]"),
    ('[[rounds.stage]]\nname = "x"\nsteps = 1\n[[rounds.stage]]\nname = "x"\nsteps = 1',
     "names ['x'] used more than once"),
    ('[[rounds.stage]]\nsteps = 1\nforgetting_margin = 2.0', "Expected `float` <= 1"),
])
def test_a_bad_sequence_is_refused_at_load_naming_the_stage(
    tmp_path: Path, stages: str, error: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        _load(tmp_path, stages)
    assert error in str(refused.value)


def test_a_gate_on_a_domain_a_stage_adds_to_its_evaluation_is_accepted(tmp_path: Path) -> None:
    config = _load(tmp_path, """
[[rounds.stage]]
steps = 1
overrides = { "scheduler.eval_domains" = ["general", "math"] }
keep = ["math"]
""")
    assert config.rounds.stage[0].keep == ["math"]


STAGE = StageConfig(steps=1, keep=["general"], forgetting_margin=0.2, reach={"arith": 0.5})


@pytest.mark.parametrize(("after", "outcome", "reason"), [
    ({"general": 0.5, "arith": 0.5}, "passed", ""),  # held, and reached exactly
    ({"general": 0.7, "arith": 0.9}, "passed", ""),
    ({"general": 0.3, "arith": 0.9}, "passed", ""),  # fell exactly the margin (0.5 - 0.3)
    ({"general": 0.5, "arith": 0.375}, "stopped", "reach: arith reached 0.375, below 0.5"),
    ({"general": 0.5}, "stopped", "reach: arith reached n/a, below 0.5"),
    ({"general": 0.25, "arith": 0.9}, "rolled_back",
     "forgetting: general fell from 0.500 to 0.250, more than the margin 0.2"),
    ({"general": 0.29, "arith": 0.1}, "rolled_back", "forgetting: general fell"),  # both: back
    ({"arith": 0.9}, "rolled_back", "forgetting: general has no held-out result at the "
                                    "stage's end"),
])
def test_gates_on_recorded_results(after: dict[str, float], outcome: str, reason: str) -> None:
    verdict = judge(STAGE, {"general": 0.5, "arith": 0.0}, after)
    assert verdict.outcome == outcome
    assert verdict.reason.startswith(reason) and bool(verdict.reason) == bool(reason)
    assert verdict.gates["keep"]["general"]["before"] == 0.5
    assert verdict.gates["keep"]["general"]["ok"] is (outcome != "rolled_back")


def test_a_kept_domain_without_a_start_value_rolls_back() -> None:
    verdict = judge(STAGE, {}, {"general": 0.9, "arith": 0.9})
    assert verdict.outcome == "rolled_back"
    assert "no held-out result at the stage's start" in verdict.reason


def test_the_start_checkpoint_is_kept_and_published_as_a_new_version(tmp_path: Path) -> None:
    # Given version 3 with weights, optimiser state and its own step's metrics
    v3 = tmp_path / "weights" / "v000003"
    v3.mkdir(parents=True)
    (v3 / "model.safetensors").write_bytes(b"weights of v3")
    (v3 / "trainer_state.pt").write_bytes(b"adam of v3")
    (v3 / "step_metrics.msgpack").write_bytes(b"step 3")
    # When a stage starts there, the version is pruned, and the stage is rolled back to v7
    saved = keep_start(tmp_path, 3, base_dir=tmp_path / "unused")
    for f in v3.iterdir():
        f.unlink()
    v3.rmdir()
    published = restore(saved, tmp_path / "weights", 7)
    # Then v7 holds v3's weights and optimiser state, not v3's step
    assert published == tmp_path / "weights" / "v000007"
    assert (published / "model.safetensors").read_bytes() == b"weights of v3"
    assert (published / "trainer_state.pt").read_bytes() == b"adam of v3"
    assert not (published / "step_metrics.msgpack").exists()
    # and both are idempotent (a crash mid-rollback is finished by the next `up`)
    assert keep_start(tmp_path, 3, base_dir=tmp_path / "unused") == saved
    assert restore(saved, tmp_path / "weights", 7) == published
    assert [p.name for p in (tmp_path / "weights").iterdir()] == ["v000007"]


def test_a_stage_starting_from_the_base_model_keeps_the_base(tmp_path: Path) -> None:
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    saved = keep_start(tmp_path / "run", 0, base_dir=base)
    assert saved.name == "start-v000000" and (saved / "config.json").read_text() == "{}"


def test_the_state_file_round_trips_and_reads_in_words(tmp_path: Path) -> None:
    state = RoundsState(planned=["sft", "rl", "rl2"], stages=[
        StageRecord(name="sft", start_version=0, end_version=4, outcome="passed"),
        StageRecord(name="rl", start_version=4, end_version=9, outcome="rolled_back",
                    reason="forgetting: general fell from 0.500 to 0.100, more than the "
                           "margin 0.05", rollback_version=10),
        StageRecord(name="rl2", start_version=10),
    ])
    state.save(tmp_path)
    again = RoundsState.load(tmp_path)
    assert again == state
    assert json.loads((tmp_path / "rounds.json").read_text())["stages"][1]["outcome"] == \
        "rolled_back"
    text = rounds_text([s.summary() for s in again.stages], 3)
    assert text.splitlines() == [
        "rounds: 2 of 3 stages judged, current stage 'rl2'",
        "  sft: v0 -> v4 passed",
        "  rl: v4 -> v9 rolled_back: forgetting: general fell from 0.500 to 0.100, more than "
        "the margin 0.05, v4's weights published as v10",
        "  rl2: v10 -> ... running",
    ]
