"""Replay: the archiver keeps trajectories beyond the streams' retention; select, show,
rescore (a changed verifier shows exactly the changed rewards), export, and retrain (one
learner step reproduced from its checkpoint)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pyarrow.parquet as pq
import pytest
import trio

import streamrl.domains.arith.domain  # noqa: F401  (registers the arith domain)
from streamrl.actors import archiver
from streamrl.actors.executor import to_outcome
from streamrl.actors.learner import serve as serve_learner
from streamrl.actors.verifier import Verifier
from streamrl.cli.replay import (
    Query,
    export,
    ledger_groups,
    recorded_step,
    render_episode,
    rescore,
    retrain,
    seen_in,
    select,
)
from streamrl.domains import registry
from streamrl.domains.arith.domain import Arith
from streamrl.protocol import names as N
from streamrl.protocol.messages import Executed, Trajectory, now
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import encode
from streamrl.queues.streams import Producer
from streamrl.runtime.context import ActorContext
from streamrl.testing.messages import make_trajectory
from streamrl.testing.wait import wait_until
from tests.ops.helpers import config, executed


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "streamrl", *args], capture_output=True, text=True, timeout=120
    )


async def _verified(*groups: object) -> list[Trajectory]:
    out = []
    for g in groups:
        o, *_ = await Verifier().handle(g)  # type: ignore[arg-type]  # output, counters
        out.append(o.message)
    return out


async def _archive_all(ctx: ActorContext, expected: int) -> Path:
    """Run the archiver until ``expected`` rows are on disk and acknowledged (a file is
    renamed into place before its entries are acknowledged)."""
    root = archiver.archive_dir(ctx.config)
    client = ctx.client

    async def pending() -> int:
        total = 0
        for s in archiver.STREAMS:
            info = await client.call(client.sync.xpending, ctx.names.stream(s), "archiver")
            total += info["pending"]
        return total

    async def archived() -> bool:
        return (
            sum(pq.read_metadata(p).num_rows for p in root.rglob("*.parquet")) >= expected
            and not await pending()
        )

    async with trio.open_nursery() as nursery:
        await nursery.start(archiver.serve, ctx)
        await wait_until(archived, timeout=20)
        nursery.cancel_scope.cancel()
    return root


async def test_archive_outlives_the_stream_and_replay_selects_shows_rescores_exports(
    client: RedisClient, names: N.Names, redis_url: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given three verified groups (one at policy v2, one held-out), archived
    a = executed("6", ["6", "7", "oops"], policy_version=1)  # right, wrong, wrong
    b = executed("9", ["9", "9"], policy_version=2)
    c = executed("4", ["5", "4"], policy_version=2, split="eval")
    trajectories = await _verified(a, b, c)
    assert [t.rewards for t in trajectories] == [[1.0, 0.0, 0.0], [1.0, 1.0], [0.0, 1.0]]
    producer = Producer(client, names)
    await producer.publish(N.TRAJECTORIES, [encode(t) for t in trajectories[:2]])
    await producer.publish(N.EVALS, [encode(trajectories[2])])
    ctx = ActorContext(config(tmp_path, redis_url, names.run), client, names)
    root = await _archive_all(ctx, 3)

    # When the streams lose them (retention) the archive still has every one
    for s in (N.TRAJECTORIES, N.EVALS):
        await client.call(client.sync.xtrim, names.stream(s), maxlen=0)
    everything = await select(client, names, Query(), root)
    assert {f.trajectory.id for f in everything} == {t.id for t in trajectories}
    assert {f.source for f in everything} == {"archive"}
    # ... and the archiver acknowledged what it wrote, nothing else
    for s in (N.TRAJECTORIES, N.EVALS):
        assert (await client.call(client.sync.xpending, names.stream(s), "archiver"))[
            "pending"] == 0

    # Selection by policy version, reward, episode, stream
    by_version = await select(client, names, Query(policy_version=2), root)
    assert {f.trajectory.id for f in by_version} == {trajectories[1].id, trajectories[2].id}
    rich = await select(client, names, Query(min_reward=0.9), root)
    assert [f.trajectory.id for f in rich] == [trajectories[1].id]
    one = await select(client, names, Query(episodes=frozenset({a.episode_id})), root)
    assert [f.trajectory.id for f in one] == [trajectories[0].id]
    evals = await select(client, names, Query(streams=(N.EVALS,)), root)
    assert [f.trajectory.id for f in evals] == [trajectories[2].id]

    # show: every turn of the three-sample episode, with its sandbox output and reward
    text = render_episode(one[0])
    for i in (1, 2, 3):
        assert f"--- turn {i}/3" in text
    assert "print('oops')" in text and "stdout: oops" in text
    assert text.count("--- sandbox: exit 0") == 3
    assert [line for line in text.splitlines() if line.startswith("--- reward")] == [
        "--- reward 1", "--- reward 0", "--- reward 0"]

    # The command: show through the CLI, and an entry id range over the archive
    base = ["--set", f"run.name={names.run}", "--set", f"run.redis_url={redis_url}",
            "--set", f"run.work_dir={tmp_path}"]
    shown = _cli("replay", "show", "--episode", a.episode_id, *base)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip() == render_episode(one[0], seen_in(ctx.config))  # its tokenizer
    second = sorted(f.entry_id for f in everything if f.stream == N.TRAJECTORIES)[1]
    listed = _cli("replay", "list", "--stream", "trajectories", "--from-id", second, *base)
    assert [r["trajectory_id"] for r in json.loads(listed.stdout)] == [trajectories[1].id]

    # rescore: unchanged verifier, no change; a verifier that credits clean runs changes
    # exactly the wrong answers that ran cleanly
    assert rescore(everything) == (7, [])
    monkeypatch.setitem(registry._instances, "arith", Arith(clean_run_credit=0.5))
    scored, changes = rescore(everything)
    assert scored == 7
    assert sorted((c.episode_id, c.sample, c.old, c.new) for c in changes) == sorted([
        (a.episode_id, 1, 0.0, 0.5), (a.episode_id, 2, 0.0, 0.5), (c.episode_id, 0, 0.0, 0.5),
    ])

    # export: JSONL with decoded token arrays, Parquet with the archive's columns
    export(everything, tmp_path / "out.jsonl", tmp_path / "out.parquet")
    lines = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [x["id"] for x in lines] == [f.trajectory.id for f in everything]
    assert lines[0]["rollout"]["samples"][0]["tokens"] == [10, 11, 12]
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.num_rows == 3 and "reward_mean" in table.column_names


async def test_retrain_reproduces_a_recorded_learner_step(
    client: RedisClient, names: N.Names, redis_url: str, tmp_path: Path
) -> None:
    # Given the real learner took one step (tiny model) on two groups, archived
    groups = [
        make_trajectory([1, 2, 3], [[5, 6, 7], [8, 9]], [[-1.0, -2.0, -0.5], [-1.5, -0.7]],
                        [1.0, 0.0]),
        make_trajectory([4, 5], [[10, 11], [12, 13, 14]], [[-0.3, -1.1], [-2.0, -0.2, -0.9]],
                        [0.0, 1.0]),
    ]
    await Producer(client, names).publish(N.TRAJECTORIES, [encode(g) for g in groups])
    cfg = config(tmp_path, redis_url, names.run, "learner.groups_per_step=2",
                 "learner.max_steps=1")
    ctx = ActorContext(cfg, client, names)
    with trio.fail_after(120):
        await serve_learner(ctx)
    root = await _archive_all(ctx, 2)
    await client.call(client.sync.xtrim, names.stream(N.TRAJECTORIES), maxlen=0)

    # When step 1 is replayed from the archive, on the base model (version 0)
    ids = ledger_groups(cfg, 1)
    found = {f.trajectory.id: f.trajectory
             for f in await select(None, names, Query(trajectory_ids=frozenset(ids)), root)}
    loss, grad_norm = retrain(cfg, 1, [found[i] for i in ids])

    # Then loss and gradient norm are the recorded ones, within float tolerance
    recorded = recorded_step(cfg, 1)
    assert recorded is not None and recorded.grad_norm > 0
    assert loss == pytest.approx(recorded.loss, rel=1e-4, abs=1e-6)
    assert grad_norm == pytest.approx(recorded.grad_norm, rel=1e-4)
    # ... and so does the command, from the archive alone (no Redis URL: none is needed)
    done = _cli("replay", "retrain", "--step", "1", "--source", "archive",
                "--set", f"run.name={names.run}", "--set", "run.redis_url=",
                "--set", f"run.work_dir={tmp_path}", "--set", "model.spec=tiny")
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout)
    assert result["matches"] is True and result["groups"] == 2
    # ... and a different selection does not reproduce it
    _, other_norm = retrain(cfg, 1, [found[ids[0]]])
    assert other_norm != pytest.approx(recorded.grad_norm, rel=1e-4)



def _math(answer: str, replies: list[str]) -> Executed:
    """A math group (no sandbox: nothing ran) whose samples answer ``replies``."""
    group = executed(answer, replies)
    spec = {"id": "math-train-x", "prompt": f"What is {answer}?", "answer": answer, "kind": "add"}
    task = msgspec.structs.replace(group.rollout.task, domain="math", item_id=spec["id"],
                                   prompt=spec["prompt"], spec=spec)  # fmt: skip
    samples = [msgspec.structs.replace(s, text=f"Answer: {r}")
               for s, r in zip(group.rollout.samples, replies, strict=True)]  # fmt: skip
    rollout = msgspec.structs.replace(group.rollout, task=task, samples=samples)
    outcomes = [to_outcome(None)] * len(replies)
    return msgspec.structs.replace(group, rollout=rollout, outcomes=outcomes)


async def test_replay_selects_by_time_range_and_domain_live_and_from_the_archive(
    client: RedisClient, names: N.Names, redis_url: str, tmp_path: Path
) -> None:
    # Given four verified groups, two arith and two math, made two hours, one hour, one
    # minute ago and now (whole seconds, as an operator types them), live and archived
    t = int(now())
    made = {
        "old": (t - 7200, executed("6", ["6", "7"])),
        "hour": (t - 3600, _math("12", ["12"])),
        "minute": (t - 60, executed("9", ["9"])),
        "now": (t, _math("5", ["5", "4"])),
    }
    groups = {}
    for name, (created_at, group) in made.items():
        [verified] = await _verified(group)
        groups[name] = msgspec.structs.replace(verified, created_at=float(created_at))
    assert [g.rewards for g in groups.values()] == [[1.0, 0.0], [1.0], [1.0], [1.0, 0.0]]
    await Producer(client, names).publish(N.TRAJECTORIES, [encode(g) for g in groups.values()])
    ctx = ActorContext(config(tmp_path, redis_url, names.run), client, names)
    root = await _archive_all(ctx, 4)
    name_of = {g.id: name for name, g in groups.items()}
    base = ["--set", f"run.name={names.run}", "--set", f"run.redis_url={redis_url}",
            "--set", f"run.work_dir={tmp_path}"]  # fmt: skip

    def listed(*selection: str) -> list[str]:
        done = _cli("replay", "list", *selection, *base)
        assert done.returncode == 0, done.stderr
        return [name_of[r["trajectory_id"]] for r in json.loads(done.stdout)]

    # When the operator selects, live and from the archive, from an hour ago up to a minute
    # ago: the hour-old group only (--since inclusive, --until exclusive); and one domain:
    # its groups only, oldest first
    window = ["--since", str(t - 3600), "--until", str(t - 60)]
    for source in ("live", "archive"):
        assert listed("--source", source, *window) == ["hour"], source
        assert listed("--source", source, "--domain", "math") == ["hour", "now"], source

    # Open-ended ranges, and a domain within a time range (the query the CLI builds)
    async def chosen(query: Query, live: RedisClient | None, archive: Path | None) -> list[str]:
        return [name_of[f.trajectory.id] for f in await select(live, names, query, archive)]

    for sources in ((client, None), (None, root)):
        assert await chosen(Query(since=t - 3600), *sources) == ["hour", "minute", "now"]
        assert await chosen(Query(until=t - 3600), *sources) == ["old"]
        assert await chosen(Query(domain="arith", since=t - 3600), *sources) == ["minute"]
        assert await chosen(Query(domain="code"), *sources) == []


async def test_show_prints_the_prompt_the_model_saw_and_the_turn_the_domain_ran(
    client: RedisClient, names: N.Names, redis_url: str, tmp_path: Path
) -> None:
    from streamrl.domains.declared import declare_domains
    from streamrl.models import load_tokenizer, resolve_model
    from streamrl.protocol.messages import Rollout, Sample, floats_to_bytes, ids_to_bytes
    from tests.ops.helpers import outcome

    # Given a declared code domain whose template has a system prompt and a response prefix
    rows = tmp_path / "sq.jsonl"
    rows.write_text(json.dumps({"id": "sq-1", "prompt": "Print the square of 7.",
                                "tests": [{"input": "", "output": "49"}]}) + "\n")
    declared = ["scheduler.eval_domains=['sq']", "domain.sq.kind='stdio'",
                f"domain.sq.data='{rows}'", "domain.sq.split.by='none'",
                "domain.sq.prompt.system='You write Python.'",
                'domain.sq.prompt.response_prefix="```python\\n"']
    cfg = config(tmp_path, redis_url, names.run, *declared)
    declare_domains(cfg.domain)
    domain = registry.get_domain("sq")
    [item] = domain.load_items("eval")
    prompt_ids = domain.render_prompt(item, load_tokenizer(resolve_model("tiny")))
    # ... and a group of it, as the model wrote it: what follows the prefix
    [group] = await _verified(executed("49", ["49"]))
    task = msgspec.structs.replace(group.rollout.task, domain="sq", item_id="sq-1",
                                   prompt=item.prompt)
    sample = Sample(tokens=ids_to_bytes([5, 6]), logprobs=floats_to_bytes([-1.0, -1.0]),
                    text="print(7 * 7)\n```", finish_reason="stop", weight_version=0)
    rollout = msgspec.structs.replace(group.rollout, task=task, samples=[sample],
                                      prompt_ids=ids_to_bytes(prompt_ids))
    assert isinstance(rollout, Rollout)
    shown = msgspec.structs.replace(group, rollout=rollout, outcomes=[outcome("49\n")],
                                    rewards=[1.0])
    await Producer(client, names).publish(N.TRAJECTORIES, [encode(shown)])
    # When the operator shows it
    sets = [a for s in [f"run.name={names.run}", f"run.redis_url={redis_url}",
                        f"run.work_dir={tmp_path}", "model.spec=tiny", *declared]
            for a in ("--set", s)]
    done = _cli("replay", "show", "--source", "live", *sets)
    assert done.returncode == 0, done.stderr[-2000:]
    # Then the prompt is the template the model saw (system prompt, chat template, the
    # prefix that opens its turn), and the turn is the script the sandbox ran
    prompt = done.stdout.split("--- prompt", 1)[1].split("--- turn", 1)[0]
    assert "You write Python." in prompt and "Print the square of 7." in prompt, prompt
    assert prompt.rstrip().endswith("```python"), prompt
    turn = done.stdout.split("--- turn 1/1", 1)[1].split("--- sandbox", 1)[0]
    assert "```python\nprint(7 * 7)\n```" in turn, turn
