"""The config of one stage of a post-training sequence (``[[rounds.stage]]``).

A stage's config is the run's config with the stage's dotted ``overrides`` on top, with no
``rounds`` of its own and ``learner.max_steps`` at the stage's end. Guarantee: a sequence
that loads is one whose every stage's config loads too (each override names an existing
setting, each value passes that setting's bounds), whose every stage has a budget, and
whose every gate names a domain the stage evaluates (trained or in
``scheduler.eval_domains``); otherwise the error names the stage and the setting.
"""

from __future__ import annotations

from typing import Any

import msgspec

OWN_SECTIONS = ("run", "rounds")
"""Sections a stage cannot override: one run (its name, Redis, work dir) for every stage."""

FREE_TABLES = ("domain",)
"""Tables whose keys are names, not settings (``domain.<name>``): any key below them."""


def stage_name(config: Any, index: int) -> str:
    return config.rounds.stage[index].name or f"stage{index}"


def _unknown_key(data: dict[str, Any], dotted: str) -> str | None:
    """Why ``dotted`` names no setting of ``data`` (the run's config as builtins), if so."""
    parts = dotted.split(".")
    if parts[0] in OWN_SECTIONS:
        return f"{parts[0]}.* is the run's, the same in every stage"
    node: Any = data
    for depth, part in enumerate(parts):
        if parts[0] in FREE_TABLES and depth >= 1:
            return None  # checked by the table's own struct once converted
        if not isinstance(node, dict) or part not in node:
            return "no such setting"
        node = node[part]
    return None


def stage_data(config: Any, index: int, max_steps: int | None = None) -> dict[str, Any]:
    """Stage ``index``'s config as builtins: the run's, its overrides applied, no rounds."""
    data: dict[str, Any] = msgspec.to_builtins(config)
    data["rounds"] = {"stage": []}
    for dotted, value in config.rounds.stage[index].overrides.items():
        node = data
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    if max_steps is not None:
        data["learner"]["max_steps"] = max_steps
    return data


def stage_config(config: Any, index: int, max_steps: int | None = None) -> Any:
    """Stage ``index``'s :class:`config.schema.Config` (``learner.max_steps`` set when given;
    the config's own type: this module is imported by the schema, not the other way round)."""
    return msgspec.convert(stage_data(config, index, max_steps), type(config))


def rounds_error(config: Any) -> str | None:
    """What is wrong with ``config.rounds``, if anything (checked when the config loads)."""
    data = msgspec.to_builtins(config)
    names = [stage_name(config, i) for i in range(len(config.rounds.stage))]
    if twice := sorted({n for n in names if names.count(n) > 1}):
        return f"rounds.stage: names {twice} used more than once"
    for index, stage in enumerate(config.rounds.stage):
        where = f"rounds.stage[{index}] ({names[index]})"
        if not stage.steps and not stage.minutes:
            return f"{where}: no budget: steps or minutes must be > 0"
        for key in stage.overrides:
            if why := _unknown_key(data, key):
                return f"{where}: override {key!r}: {why}"
        try:
            staged = stage_config(config, index)
        except msgspec.ValidationError as exc:
            return f"{where}: overrides: {exc}"
        evaluated = {*staged.scheduler.domains, *staged.scheduler.eval_domains}
        for domain in [*stage.reach, *stage.keep]:
            if domain not in evaluated:
                return (f"{where}: gate domain {domain!r} is not evaluated in this stage "
                        f"(not in scheduler.domains or scheduler.eval_domains)")
        for domain, reward in stage.reach.items():
            if not 0.0 <= reward <= 1.0:
                return f"{where}: reach.{domain} = {reward}: a held-out reward is in [0, 1]"
    return None
