"""``streamrl status``: per-stream backlog, policy version, dead letters (text or JSON)."""

from __future__ import annotations

import json

import msgspec

from actors.config import Config
from actors.context import open_context
from queues import names as N
from queues.messages import WeightsPublished, decode
from queues.stats import pipeline_state, stream_length
from queues.streams import EventReader


async def print_status(config: Config, as_json: bool) -> int:
    async with open_context(config, "monitor") as ctx:
        groups = await pipeline_state(ctx.client, ctx.names)
        reader = EventReader(ctx.client, ctx.names, N.WEIGHTS)
        latest = await reader.latest()
        reader.close()
        version = decode(latest[1], WeightsPublished).version if latest else 0
        dead = await stream_length(ctx.client, ctx.names, N.DEAD)
    status = {
        "run": config.run.name,
        "policy_version": version,
        "dead_letters": dead,
        "streams": [msgspec.to_builtins(g.__dict__) for g in groups],
    }
    if as_json:
        print(json.dumps(status, indent=2))
        return 0
    print(f"run {status['run']}: policy v{version}, {dead} dead letters")
    print(f"{'stream':<14}{'group':<12}{'length':>8}{'lag':>8}{'pending':>9}{'consumers':>11}")
    for g in groups:
        print(f"{g.stream:<14}{g.group:<12}{g.length:>8}{g.lag:>8}{g.pending:>9}{g.consumers:>11}")
    return 0
