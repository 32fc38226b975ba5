"""Redis only in the broker, and each role's grants derived from its table of operations.

- no module of the package outside ``queues/`` imports redis-py or reaches a client's
  ``.sync`` connection (every Redis call goes through ``streamrl.queues``);
- the ACL grants of a role are exactly what its operations (``protocol.roles.ROLE_OPS``)
  derive: code that performs an operation its role's table lacks is refused by Redis;
- docs/security.md prints the table as derived.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import redis

import streamrl
from streamrl.actors.scheduler import Scheduler
from streamrl.config.schema import load_config
from streamrl.protocol import names as N
from streamrl.protocol import roles
from streamrl.protocol.roles import ROLE_OPS, STOP, role_table
from streamrl.queues.acl import role_url
from streamrl.queues.client import RedisClient
from streamrl.queues.operations import ReadFlag
from streamrl.runtime.context import ActorContext
from tests.helpers import role_credentials

REPO = Path(__file__).resolve().parents[2]
PACKAGE_FOLDERS = (
    "protocol", "runtime", "config", "cli", "actors", "sandbox", "learner", "inference",
    "domains", "testing",
)
"""Every folder of the package but the broker (``queues/``)."""


def _redis_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
        where = f"{shown}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [f"{where} import {a.name}" for a in node.names if a.name.split(".")[0]
                      in ("redis", "hiredis")]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in (
            "redis", "hiredis"
        ):
            found.append(f"{where} from {node.module} import")
        elif isinstance(node, ast.Attribute) and node.attr in ("sync", "execute_command"):
            found.append(f"{where} .{node.attr}")
    return found


def test_no_redis_call_outside_the_broker() -> None:
    # Given every module of the package outside queues/
    paths = [p for folder in PACKAGE_FOLDERS for p in (REPO / folder).rglob("*.py")]
    paths += list(Path(streamrl.__file__).parent.glob("*.py"))
    assert len(paths) > 50
    # Then none imports redis-py or uses a client's synchronous connection
    found = [use for path in paths for use in _redis_uses(path)]
    assert found == []


def test_the_scan_finds_a_redis_call(tmp_path: Path) -> None:
    # The check above would see a raw call (guards against a scan that finds nothing)
    probe = tmp_path / "probe.py"
    probe.write_text("import redis\nasync def f(c):\n    await c.call(c.sync.get, 'k')\n")
    assert len(_redis_uses(probe)) == 2


def test_docs_print_the_role_table_as_derived() -> None:
    doc = (REPO / "docs" / "security.md").read_text()
    start = doc.index("<!-- role table:")
    table = doc[doc.index("\n", start) + 1 : doc.index("<!-- end of role table -->")]
    assert table == role_table(), "docs/security.md: paste protocol.roles.role_table() back in"


def test_every_role_has_a_table_of_operations() -> None:
    assert set(ROLE_OPS) == set(roles.ROLES)
    assert all(ROLE_OPS[r] for r in roles.ROLES)


async def _scheduler_as_user(
    client: RedisClient, names: N.Names, redis_url: str, tmp_path: Path
) -> tuple[Scheduler, RedisClient]:
    credentials = {"scheduler": role_credentials(names)["scheduler"]}
    await roles.apply_acls(client, names, credentials)
    as_user = RedisClient(role_url(client.url.url, credentials["scheduler"]))
    config = load_config(None, [
        f"run.name={names.run}", f"run.redis_url={redis_url}", f"run.work_dir={tmp_path}",
    ])
    return Scheduler(ActorContext(config, as_user, names)), as_user


async def test_an_operation_missing_from_the_role_table_is_refused(
    client: RedisClient, names: N.Names, redis_url: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given the scheduler's user made from its table, as the table is: admission is checked
    scheduler, as_user = await _scheduler_as_user(client, names, redis_url, tmp_path)
    user = role_credentials(names)["scheduler"].user
    try:
        count, admitted = await scheduler.admissible(0)
        assert admitted == 0 and count > 0
        # When its table lacks one operation the scheduler performs (reading the stop flag)
        without = tuple(op for op in ROLE_OPS["scheduler"] if op != ReadFlag(STOP))
        assert len(without) == len(ROLE_OPS["scheduler"]) - 1
        monkeypatch.setitem(ROLE_OPS, "scheduler", without)
        as_user.close()
        scheduler, as_user = await _scheduler_as_user(client, names, redis_url, tmp_path)
        # Then the user derived from the table is refused that operation
        with pytest.raises(redis.exceptions.NoPermissionError, match="permissions"):
            await scheduler.admissible(0)
    finally:
        as_user.close()
        client.sync.execute_command("ACL", "DELUSER", user)
