"""An operator command that Redis's ACL refuses says so: ``streamrl dlq requeue`` as an admin
user without a permission the requeue needs (users created by an older release, a hand-edited
ACL) reports the refusal, not "cannot reach Redis". Real Redis, the real CLI entry point."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamrl.protocol import names as N
from streamrl.queues.client import RedisClient
from tests.chaos.badinputs import _task
from tests.ops.test_admin_role import _admin_users, _letter, _streamrl


def test_an_acl_refusal_in_dlq_requeue_is_reported_as_one(
    client: RedisClient, names: N.Names, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from streamrl.queues.codec import encode

    with _admin_users(client, names, tmp_path, monkeypatch) as (cfg, admin):
        # Given a dead letter, and the run's admin user stripped of its grants (as after a
        # hand-edited ACL: it may still log in)
        client.sync.xadd(names.stream(N.DEAD), _letter(N.TASKS, encode(_task()), "boom"))
        client.sync.execute_command("ACL", "SETUSER", admin.user, "clearselectors")

        # When the operator requeues it
        rc, out, err = _streamrl(cfg, "dlq", "requeue", "--all")

    # Then the command fails saying Redis's ACL refused it, and what
    assert rc == 2, out + err
    assert "cannot reach Redis" not in err
    assert "refused by Redis's ACL" in err and "no permissions" in err, err
    # and the letter is still there, nothing requeued
    assert client.sync.xlen(names.stream(N.DEAD)) == 1
    assert client.sync.exists(names.stream(N.TASKS)) == 0
