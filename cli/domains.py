"""``streamrl domains list|lift``: the quarantined domains of a run, and lifting them.

A domain is quarantined by the scheduler when too many of its recent training groups were
dead-lettered (``scheduler.quarantine_after`` of the last ``quarantine_window``); it then gets
no new admissions until lifted here, when the scheduler admits it again (its recent failures
forgotten). Runs as the ``admin`` role (protocol/roles.py: ReadHash, DeleteFields of the
``quarantine`` hash)."""

from __future__ import annotations

import json

from streamrl.protocol import names as N
from streamrl.protocol.quarantine import lift, quarantined
from streamrl.queues.client import RedisClient


async def run_domains(
    client: RedisClient, names: N.Names, action: str, domains: list[str], *, as_json: bool
) -> int:
    """``list``: every quarantined domain and why; ``lift``: lift ``domains`` (exit 1 if one
    of them was not quarantined)."""
    if action == "list":
        held = await quarantined(client, names)
        if as_json:
            print(json.dumps({d: {"why": w.describe(), "failed": w.failed, "groups": w.groups,
                                  "causes": w.causes, "at": w.at} for d, w in held.items()}))
        else:
            for d, why in held.items():
                print(f"{d}: quarantined, {why.describe()}")
            if not held:
                print("no domain is quarantined")
        return 0
    lifted = await lift(client, names, domains)
    for d in domains:
        print(f"{d}: lifted" if d in lifted else f"{d}: not quarantined")
    return 0 if len(lifted) == len(set(domains)) else 1
