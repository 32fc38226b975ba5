"""Post-training rounds (``[[rounds.stage]]``): ``streamrl up`` runs the stages in order on
one run, checks each stage's gates and rolls back a stage that made a kept domain forget.

Guarantees:

- every stage starts from the weights the previous one left: its end weights when it
  passed, its start weights when it was rolled back. Policy versions only go up: a rollback
  writes the stage's start checkpoint (weights, and the optimiser state where it was kept)
  as a NEW version, announced on the weights stream as the learner role announces a step
  (the generators load it like any update), and an evaluation round of it follows;
- a gate is judged on the monitor's held-out results only: the round at the stage's start
  version and the final round at its end version, per domain (:func:`judge`);
- the sequence's state (``<run dir>/rounds.json``, replaced atomically) records a stage's
  verdict before anything acts on it, so ``up`` on the run again continues the current stage
  with what is left of its budget, finishes a rollback a crash interrupted, or ends at once
  when the sequence is done.

Start checkpoints are kept in ``<run dir>/rounds/start-v<N>`` (hard links to the version's
files where the file system allows: versions are immutable), since ``learner.keep_last``
may prune the version itself during the stage.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgspec

from streamrl.config.rounds import stage_config, stage_name
from streamrl.config.schema import Config, StageConfig

STATE_FILE = "rounds.json"
VERSION_DIR = "v{:06d}"  # learner/weights.py's layout (not imported: it loads torch, and
# ``status`` and ``report`` read this module)
STEP_METRICS_FILE = "step_metrics.msgpack"  # a version's own step (actors/learner.py): not copied
TOLERANCE = 1e-9
"""Rewards are means of 0/1 scores: a fall of exactly the margin (0.5 - 0.3 against 0.2)
must not fail on the float rounding of the subtraction."""

Outcome = Literal["", "passed", "rolled_back", "stopped"]


class StageRecord(msgspec.Struct, kw_only=True):
    """One stage as run: where it started and ended, what was measured, what was decided."""

    name: str
    start_version: int
    end_version: int | None = None
    before: dict[str, float] = {}
    """Held-out reward per domain at the start version."""
    after: dict[str, float] = {}
    """Held-out reward per domain at the end version (the stage's final round)."""
    gates: dict[str, Any] = {}
    outcome: Outcome = ""
    """Empty while the stage runs (or was interrupted: ``up`` continues it)."""
    reason: str = ""
    spent_s: float = 0.0
    """Seconds of the stage's training so far (its ``minutes`` budget)."""
    rollback_version: int | None = None
    """The version its start checkpoint was published as (rolled back only)."""
    rollback_eval: dict[str, float] = {}
    """Held-out reward per domain of that version."""

    def summary(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)  # type: ignore[no-any-return]


class RoundsState(msgspec.Struct, kw_only=True):
    planned: list[str] = []
    """Every stage's name, in order (judged, running and to come)."""
    stages: list[StageRecord] = []
    """The stages started so far, in order."""

    @classmethod
    def load(cls, run_dir: Path) -> RoundsState:
        path = run_dir / STATE_FILE
        return msgspec.json.decode(path.read_bytes(), type=cls) if path.exists() else cls()

    def save(self, run_dir: Path) -> None:
        path = run_dir / STATE_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(msgspec.json.format(msgspec.json.encode(self)) + b"\n")
        os.replace(tmp, path)

    def stopped(self) -> bool:
        return any(s.outcome == "stopped" for s in self.stages)

    def start_eval(self) -> dict[str, float]:
        """The held-out rewards of the weights the next stage starts from."""
        if not self.stages:
            return {}
        last = self.stages[-1]
        return last.rollback_eval if last.outcome == "rolled_back" else last.after


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome
    reason: str
    gates: dict[str, Any] = field(default_factory=dict)


def judge(stage: StageConfig, before: dict[str, float], after: dict[str, float]) -> Verdict:
    """The stage's outcome from the held-out rewards per domain at its start and end.

    A ``keep`` domain that fell more than ``forgetting_margin`` (exactly the margin passes),
    or that has no value at either end, rolls the stage back; otherwise a ``reach`` domain
    below its target (or not evaluated) stops the sequence; otherwise the stage passed."""
    keep: dict[str, Any] = {}
    forgot: list[str] = []
    for domain in stage.keep:
        b, a = before.get(domain), after.get(domain)
        ok = b is not None and a is not None and b - a <= stage.forgetting_margin + TOLERANCE
        keep[domain] = {"before": b, "after": a, "margin": stage.forgetting_margin, "ok": ok}
        if not ok:
            forgot.append(
                f"{domain} fell from {_r(b)} to {_r(a)}, more than the margin "
                f"{stage.forgetting_margin:g}" if b is not None and a is not None
                else f"{domain} has no held-out result at the stage's "
                     f"{'start' if b is None else 'end'}")
    reach: dict[str, Any] = {}
    short: list[str] = []
    for domain, target in stage.reach.items():
        a = after.get(domain)
        ok = a is not None and a >= target - TOLERANCE
        reach[domain] = {"target": target, "after": a, "ok": ok}
        if not ok:
            short.append(f"{domain} reached {_r(a)}, below {target:g}")
    gates = {"keep": keep, "reach": reach}
    if forgot:
        return Verdict("rolled_back", "forgetting: " + "; ".join(forgot), gates)
    if short:
        return Verdict("stopped", "reach: " + "; ".join(short), gates)
    return Verdict("passed", "", gates)


def _r(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or one without hard links
        shutil.copy2(src, dst)


def keep_start(run_dir: Path, version: int, base_dir: Path) -> Path:
    """The start checkpoint of a stage that starts at ``version`` (0: the base model), kept
    under ``rounds/``; idempotent."""
    saved = run_dir / "rounds" / f"start-v{version:06d}"
    if saved.is_dir():
        return saved
    source = run_dir / "weights" / VERSION_DIR.format(version) if version else base_dir
    tmp = saved.with_name(f".{saved.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp, copy_function=_link_or_copy,
                    ignore=shutil.ignore_patterns(STEP_METRICS_FILE, ".*"))
    os.replace(tmp, saved)
    return saved


def restore(saved: Path, weights_root: Path, version: int) -> Path:
    """Write the kept checkpoint ``saved`` as weights version ``version`` (atomically, as
    :func:`learner.weights.save_weights` does); idempotent."""
    target = weights_root / VERSION_DIR.format(version)
    if target.is_dir():
        return target
    tmp = weights_root / f".{target.name}.rollback.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(saved, tmp, copy_function=_link_or_copy)
    os.replace(tmp, target)
    return target


class EvalResult(msgspec.Struct):
    """An evaluation round's figures as :class:`Rounds` needs them."""

    version: int
    by_domain: dict[str, float]


Evaluate = Callable[[int], Awaitable[EvalResult | None]]
"""Evaluate a policy version (the generators serving it): its held-out round, None when it
did not finish."""
Announce = Callable[[int], Awaitable[None]]
"""Announce a version on disk on the weights stream, as the learner role (the generators
load it like any update)."""


@dataclass
class StageRun:
    """What ``up`` (cli/up.py) asks of a stage while it supervises it."""

    rounds: Rounds
    index: int
    config: Config
    budget_deadline: float
    """When the stage's ``minutes`` are spent (monotonic; inf without minutes)."""
    accounted: float = field(default_factory=time.monotonic)
    """Until when its time is counted in ``spent_s``."""

    def account(self) -> None:
        """Count the time since the last call in the stage's ``spent_s``."""
        now = time.monotonic()
        self.record.spent_s += now - self.accounted
        self.accounted = now

    @property
    def record(self) -> StageRecord:
        return self.rounds.state.stages[self.index]

    @property
    def stage(self) -> StageConfig:
        return self.rounds.config.rounds.stage[self.index]

    async def before_training(self, evaluate: Evaluate) -> None:
        """Before the learner and scheduler start: evaluate the start weights if a kept
        domain has no value at the stage's start yet."""
        rec = self.record
        if all(d in rec.before for d in self.stage.keep):
            return
        print(f"streamrl: stage {rec.name!r}: evaluating its start, policy "
              f"v{rec.start_version}", flush=True)
        result = await evaluate(rec.start_version)
        if result is not None:
            rec.before = {**rec.before, **result.by_domain}
            self.rounds.save()

    async def after_final_eval(self, final: EvalResult | None, evaluate: Evaluate,
                               announce: Announce) -> None:
        """The final round is in: judge the stage if its budget is spent, roll it back if a
        kept domain forgot (publish its start checkpoint as a new version and evaluate it)."""
        rec, stage = self.record, self.stage
        # (the monitor's last step: below the start after a rollback, until a step is taken)
        version = max(final.version if final is not None else 0, rec.start_version)
        steps_spent = bool(stage.steps) and version >= rec.start_version + stage.steps
        if not (steps_spent or time.monotonic() >= self.budget_deadline):
            print(f"streamrl: stage {rec.name!r} interrupted at v{version}; `up` continues it",
                  flush=True)
            return
        rec.end_version = version
        if final is None:
            verdict = Verdict("stopped", "the stage's final evaluation did not finish")
        else:
            rec.after = final.by_domain
            verdict = judge(stage, rec.before, rec.after)
        rec.outcome, rec.reason, rec.gates = verdict.outcome, verdict.reason, verdict.gates
        self.account()
        if verdict.outcome == "rolled_back":
            rec.rollback_version = self.rounds.latest_version() + 1
        self.rounds.save()  # the verdict first: a crash from here on is finished by `up`
        print(f"streamrl: stage {rec.name!r}: {rec.outcome}"
              + (f" ({rec.reason})" if rec.reason else ""), flush=True)
        if rec.outcome == "rolled_back":
            await self.rounds.finish_rollback(rec, evaluate, announce)


@dataclass
class Rounds:
    """The sequence of one run: its state, each stage's config and start checkpoint."""

    config: Config
    base_dir: Path
    state: RoundsState = field(default_factory=RoundsState)

    def __post_init__(self) -> None:
        self.state = RoundsState.load(self.run_dir)
        self.state.planned = [stage_name(self.config, i)
                              for i in range(len(self.config.rounds.stage))]

    @property
    def run_dir(self) -> Path:
        return self.config.run.path

    @property
    def weights(self) -> Path:
        return self.run_dir / "weights"

    def save(self) -> None:
        self.state.save(self.run_dir)

    def latest_version(self) -> int:
        from streamrl.learner.weights import latest_version

        return latest_version(self.weights) or 0

    def finished(self) -> bool:
        return self.state.stopped() or (
            len(self.state.stages) == len(self.config.rounds.stage)
            and all(s.outcome for s in self.state.stages))

    def pending_rollback(self) -> StageRecord | None:
        """A rolled-back stage whose new version or its evaluation a crash interrupted."""
        last = self.state.stages[-1] if self.state.stages else None
        if last is not None and last.outcome == "rolled_back" and not last.rollback_eval:
            return last
        return None

    def next_stage(self, now: float) -> StageRun:
        """The current stage (a new record when the last one is judged), with its config:
        ``learner.max_steps`` at its start version + ``steps``."""
        stages = self.state.stages
        index = len(stages) - 1 if stages and not stages[-1].outcome else len(stages)
        if index == len(stages):
            start = self.latest_version()
            keep_start(self.run_dir, start, self.base_dir)
            stages.append(StageRecord(name=stage_name(self.config, index), start_version=start,
                                      before=dict(self.state.start_eval())))
            self.save()
        rec, stage = stages[index], self.config.rounds.stage[index]
        max_steps = rec.start_version + stage.steps if stage.steps else 0
        left = stage.minutes * 60 - rec.spent_s if stage.minutes else float("inf")
        return StageRun(self, index, stage_config(self.config, index, max_steps), now + left)

    async def finish_rollback(self, rec: StageRecord, evaluate: Evaluate,
                              announce: Announce) -> None:
        """Publish the stage's start checkpoint as ``rec.rollback_version`` and evaluate it."""
        assert rec.rollback_version is not None
        saved = self.run_dir / "rounds" / f"start-v{rec.start_version:06d}"
        restore(saved, self.weights, rec.rollback_version)
        print(f"streamrl: stage {rec.name!r} rolled back: the weights of v{rec.start_version} "
              f"published as v{rec.rollback_version}", flush=True)
        await announce(rec.rollback_version)
        result = await evaluate(rec.rollback_version)
        rec.rollback_eval = result.by_domain if result is not None else {}
        self.save()

    def summary(self) -> list[dict[str, Any]]:
        return [s.summary() for s in self.state.stages]


def rounds_text(stages: list[dict[str, Any]], total: int) -> str:
    """The sequence in a few lines (``up``'s summary, ``status``, ``report``)."""
    judged = sum(1 for s in stages if s["outcome"])
    stopped = any(s["outcome"] == "stopped" for s in stages)
    current = next((s["name"] for s in stages if not s["outcome"]), None)
    state = ("stopped" if stopped else f"current stage {current!r}" if current
             else "done" if judged == total else "between stages")
    lines = [f"rounds: {judged} of {total} stages judged, {state}"]
    for s in stages:
        end = s["end_version"]
        span = f"v{s['start_version']} -> " + (f"v{end}" if end is not None else "...")
        outcome = s["outcome"] or "running"
        back = (f", v{s['start_version']}'s weights published as v{s['rollback_version']}"
                if s["outcome"] == "rolled_back" else "")
        reason = f": {s['reason']}" if s["reason"] else ""
        lines.append(f"  {s['name']}: {span} {outcome}{reason}{back}")
    return "\n".join(lines)


def run_rounds(run_dir: Path) -> RoundsState | None:
    """The run's sequence as ``up`` last wrote it (None: the run has no rounds)."""
    return RoundsState.load(run_dir) if (run_dir / STATE_FILE).exists() else None


def rounds_lines(run_dir: Path) -> list[str]:
    """``status``'s and ``report``'s lines on the sequence (none without rounds)."""
    state = run_rounds(run_dir)
    if state is None:
        return []
    return rounds_text([s.summary() for s in state.stages], len(state.planned)).splitlines()
