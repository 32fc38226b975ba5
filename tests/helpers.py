"""Helpers shared by test packages (fixtures live in the conftest files)."""

from __future__ import annotations

from pathlib import Path

from actors.config import Config, load_config


def run_config(tmp_path: Path, redis_url: str, run: str, *overrides: str) -> Config:
    """The config of run ``run`` on ``redis_url`` with its work dir in ``tmp_path``, plus
    ``overrides`` (dotted ``key=value``, as on the command line)."""
    return load_config(
        None,
        [f"run.name={run}", f"run.redis_url={redis_url}", f"run.work_dir={tmp_path}", *overrides],
    )
