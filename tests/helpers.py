"""Helpers shared by test packages (fixtures live in the conftest files)."""

from __future__ import annotations

import secrets
from pathlib import Path

from actors.config import Config, load_config
from queues.acl import ROLES, Credentials
from queues.names import Names


def run_config(tmp_path: Path, redis_url: str, run: str, *overrides: str) -> Config:
    """The config of run ``run`` on ``redis_url`` with its work dir in ``tmp_path``, plus
    ``overrides`` (dotted ``key=value``, as on the command line)."""
    return load_config(
        None,
        [f"run.name={run}", f"run.redis_url={redis_url}", f"run.work_dir={tmp_path}", *overrides],
    )


def role_credentials(names: Names) -> dict[str, Credentials]:
    """A user and a random password for every ACL role of run ``names``."""
    return {r: Credentials(f"streamrl-{names.run}-{r}", secrets.token_hex(16)) for r in ROLES}
