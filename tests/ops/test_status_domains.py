"""``streamrl status``'s per-domain lines at scale (30 domains), read as the run's ``admin``
user: the top N by backlog, then failures; ``--all``; a quarantined domain with its reason;
each domain's failures by stage and cause; a forgetting eval-only domain; the JSON."""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from streamrl.config.schema import Config
from streamrl.protocol import names as N
from streamrl.protocol.quarantine import Why, quarantine
from streamrl.queues.client import RedisClient, RedisURL
from streamrl.runtime.auth import apply_role_users, credentials_for_up
from tests.ops.helpers import config as ops_config

DOMAINS = [f"d{i:02d}" for i in range(30)]
WHY = Why(failed=4, groups=5, causes={"verifier:error": 4}, at=1.0)


@pytest.fixture
def admin_config(
    redis_url: str, names: N.Names, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Config]:
    """The run's users as `streamrl up` creates them and a config with auth on and a URL
    without credentials: status gets in as the admin role (its password in the env) or not
    at all."""
    password = secrets.token_hex(16)
    monkeypatch.setenv("STREAMRL_PASSWORD_ADMIN", password)
    monkeypatch.delenv("STREAMRL_REDIS_URL", raising=False)
    bare = RedisURL(redis_url).without_credentials().url
    domains = ",".join(f"'{d}'" for d in DOMAINS)
    cfg = ops_config(tmp_path, bare, names.run, "auth.enabled=true",
                     f"scheduler.domains=[{domains}]", "scheduler.eval_domains=['general']",
                     "scheduler.forgetting_margin=0.1")  # fmt: skip
    credentials = credentials_for_up(cfg, {"STREAMRL_PASSWORD_ADMIN": password})
    trio.run(apply_role_users, cfg, redis_url, credentials)
    superuser = RedisClient(redis_url)
    try:
        yield cfg
        log = superuser.sync.acl_log(count=128)
        assert [e for e in log if e["username"] == credentials["admin"].user] == []
    finally:
        superuser.sync.execute_command("ACL", "DELUSER", *(c.user for c in credentials.values()))
        superuser.close()


def _rows(out: str) -> list[list[str]]:
    """The per-domain lines of ``status``'s text, split in words."""
    return [line.split() for line in out.splitlines()
            if re.match(r"(d\d\d|general) ", line)]


def _status(cfg: Config, *args: str) -> str:
    sets = [f"run.name={cfg.run.name}", f"run.redis_url={cfg.run.redis_url}",
            f"run.work_dir={cfg.run.work_dir}", "auth.enabled=true",
            "scheduler.eval_domains=['general']", "scheduler.forgetting_margin=0.1",
            "scheduler.domains=[" + ",".join(f"'{d}'" for d in DOMAINS) + "]"]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "streamrl", "status", "--samples", "1", *args,
         *(a for s in sets for a in ("--set", s))],
        env=dict(os.environ), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


async def test_status_lists_the_top_domains_by_backlog_then_failures(
    client: RedisClient, names: N.Names, admin_config: Config
) -> None:
    # Given 30 domains, d<i> with 100 admitted groups and a backlog of i // 2 (pairs tie),
    # the odd one of each pair with one group dead-lettered by its verifier (scorer error),
    # as the admission, verifier and dead-letter scripts count them
    for i, d in enumerate(DOMAINS):
        failed = i % 2
        await client.call(client.sync.hincrby, names.admitted_by_domain, d, 100)
        await client.call(client.sync.incrby, names.counter(f"resolved:{d}"), 100 - i // 2)
        for key in (N.failed_counter(d), N.failed_counter(d, "verifier", "error")):
            await client.call(client.sync.incrby, names.counter(key), failed)
    # and d03 quarantined, and the eval-only `general` falling 0.9 -> 0.5 over two rounds
    await quarantine(client, names, "d03", WHY)
    admin_config.run.path.mkdir(parents=True, exist_ok=True)
    with (admin_config.run.path / "evals.jsonl").open("w") as f:
        for round_no, reward in ((0, 0.9), (1, 0.5)):
            f.write(json.dumps({"round": round_no, "item_id": "g", "domain": "general",
                                "reward": reward, "weight_version": round_no}) + "\n")

    # When the operator runs `streamrl status` (as the admin role), by default
    out = _status(admin_config)
    # Then it shows the 10 domains with the largest backlog, ties broken by failures
    rows = _rows(out)
    assert [r[0] for r in rows] == [f"d{i}" for i in range(29, 19, -1)]
    assert "domains: top 10 of 31 by backlog, then failures" in out
    d29 = rows[0]
    assert d29[1:7] == ["100", "86", "0", "14", "1", "-"] and "verifier error 1" in " ".join(d29)
    # and the quarantined domain and the forgetting one, each with why
    assert f"quarantined d03: {WHY.describe()} (lift: streamrl domains lift d03)" in out
    assert "forgetting general:" in out

    # When it asks for the top 3, as JSON
    status = json.loads(_status(admin_config, "--top", "3", "--json"))
    # Then the JSON has those 3, with their figures, of 31
    assert [d["name"] for d in status["domains"]] == ["d29", "d28", "d27"]
    assert status["domains_total"] == 31 and status["forgetting"] == ["general"]
    assert status["domains"][0] == {
        "name": "d29", "admitted": 100, "resolved": 86, "trained": 0, "backlog": 14,
        "failed": 1, "failed_by": {"verifier:error": 1}, "train_reward": None,
        "quarantined": None, "forgetting": False,
    }
    assert status["quarantined"] == {"d03": WHY.describe()}

    # When it asks for --all
    out = _status(admin_config, "--all")
    rows = _rows(out)
    # Then every domain is listed, in the same order, quarantined and forgetting marked
    assert [r[0] for r in rows][:30] == [f"d{i:02d}" for i in range(29, -1, -1)]
    assert len(rows) == 31 and "domains: 31" in out
    line = {r[0]: " ".join(r) for r in rows}
    assert f"QUARANTINED: {WHY.describe()}" in line["d03"]
    assert line["general"].endswith("FORGETTING")
