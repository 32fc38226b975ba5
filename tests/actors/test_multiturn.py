"""Multi-turn episodes through the real actors, on a real Redis, in the real process sandbox.

The model is replaced by a scripted :class:`~inference.engine.Engine` (fixed shell commands
per turn, tokenised with the real tokenizer) because these tests are about the episode
machinery, not the model: turns, observations, the loss mask, crash safety across replicas,
and that every sandbox session is released on every exit path. The tiny real model runs the
same domain end to end in ``test_multiturn_model.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import trio

from streamrl.actors.episodes import EpisodeSessions
from streamrl.actors.executor import Executor, Sandboxes, from_outcome
from streamrl.actors.generator import Generator
from streamrl.actors.scheduler import make_task
from streamrl.actors.verifier import Verifier
from streamrl.cli.replay import Found, render_episode
from streamrl.config.schema import DomainConfig
from streamrl.domains import registry
from streamrl.domains.base import EpisodePolicy, chat_observation_ids
from streamrl.domains.registry import get_domain, register
from streamrl.domains.terminal import Terminal, TerminalItem
from streamrl.inference.engine import Completion
from streamrl.learner.batch import build_batch
from streamrl.models import load_tokenizer, resolve_model
from streamrl.protocol import names as N
from streamrl.protocol.messages import Sampling, Trajectory, bytes_to_floats, bytes_to_ids
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import DeadLetter, decode, encode
from streamrl.queues.streams import FIELD, ConsumerSettings, Producer, open_stream_consumer
from streamrl.runtime.policies import Policies, Reject, RetryPolicy
from streamrl.runtime.serve import Actor, ActorRuntime, RuntimeSettings
from streamrl.sandbox import ExecRequest, Limits, SandboxUnavailable, open_sandbox, opened
from streamrl.testing.processes import descendants
from streamrl.testing.wait import wait_until
from tests.domains.test_terminal import fence, item_of, solution

TERMINAL = get_domain("terminal")
REPO = Path(__file__).resolve().parents[2]
LOGPROB = -0.5  # what the scripted engine reports for each of its tokens


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(resolve_model("tiny"))


Script = Callable[[int, int], str]  # (turn, position in the call) -> reply


class ScriptedEngine:
    """An Engine whose replies are fixed per turn (the turn is read off the prompt: the number
    of assistant headers in it). ``hold_turn``: calls for that turn wait for ``release``."""

    def __init__(self, tokenizer: Any, script: Script, hold_turn: int = 0) -> None:
        self.tokenizer = tokenizer
        self.script = script
        self.hold_turn = hold_turn
        self.release = trio.Event()
        self.calls: list[tuple[int, list[list[int]]]] = []

    @property
    def weight_version(self) -> int:
        return 0

    def reply_ids(self, text: str) -> list[int]:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return [int(i) for i in ids] + [int(self.tokenizer.eos_token_id)]

    async def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Completion]:
        turn = self.tokenizer.decode(prompts[0]).count("<|im_start|>assistant")
        self.calls.append((turn, prompts))
        if turn == self.hold_turn:
            await self.release.wait()
        out = []
        for pos in range(len(prompts)):
            text = self.script(turn, pos)
            ids = np.array(self.reply_ids(text), dtype=np.int32)
            out.append(Completion(tokens=ids, logprobs=np.full(len(ids), LOGPROB, np.float32),
                                  text=text, finish_reason="stop", weight_version=0))
        return out

    async def update_weights(self, path: Any, version: int) -> None:
        pass


@dataclass
class Replica:
    """One actor on its input stream as a named consumer, killable (its cancel scope); an
    executor's sandboxes are opened for its life, as the executor's own ``serve`` does."""

    actor: Actor[Any]
    name: str
    time_limit_s: float = 60.0
    max_retries: int = 2
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    runtime: ActorRuntime | None = None

    async def serve(self, client: RedisClient, names: N.Names, *,
                    task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        settings = ConsumerSettings(block_ms=100, reclaim_min_idle_ms=600, trim_interval_s=0)
        policies = Policies(retry=RetryPolicy(self.max_retries, 0.05, 0.1),
                            time_limit_s=self.time_limit_s)
        with self.scope:
            async with AsyncExitStack() as stack:
                if isinstance(self.actor, Executor):
                    await stack.enter_async_context(self.actor.sandboxes.opened())
                consumer = await stack.enter_async_context(open_stream_consumer(
                    client, names, self.actor.input_stream, stage=self.actor.stage,
                    consumer=self.name, settings=settings))
                self.runtime = ActorRuntime(consumer, self.actor, policies, RuntimeSettings(
                    concurrency=2, heartbeat_interval_s=0.2, reclaim_interval_s=0.2))
                await self.runtime.serve(task_status=task_status)

    def handled(self) -> int:
        return self.runtime.statistics().handled if self.runtime else 0


def executor(turns: int = 6, idle_s: float = 600.0) -> Executor:
    sandboxes = Sandboxes("process")
    return Executor(sandboxes, EpisodeSessions(sandboxes, idle_s=idle_s),
                    {"terminal": DomainConfig(max_turns=turns)})


async def publish_task(client: RedisClient, names: N.Names, item: TerminalItem,
                       group: int) -> str:
    task = make_task("terminal", item, split="train", group_size=group,
                     sampling=Sampling(max_new_tokens=64), version=0)
    # admitted as the scheduler admits it: the verifier counts only an admitted group
    await client.call(client.sync.sadd, names.admitted_groups, task.id)
    await Producer(client, names).publish(N.TASKS, [encode(task)])
    return task.id


async def entries(client: RedisClient, names: N.Names, stream: str) -> list[bytes]:
    raw = await client.call(client.sync.xrange, names.stream(stream))
    return [f[FIELD] for _, f in raw]


async def trajectory(client: RedisClient, names: N.Names) -> Trajectory:
    async def one() -> bool:
        return len(await entries(client, names, N.TRAJECTORIES)) >= 1

    await wait_until(one, timeout=60)
    [raw] = await entries(client, names, N.TRAJECTORIES)
    return decode(raw, Trajectory)


NOT_SANDBOX = ("redis", "valkey", "multiprocessing.resource_tracker", "multiprocessing.forkserver")
"""Descendants of the test process that are no sandbox's: the session's Redis, and the
helpers Python's multiprocessing starts once per process (an earlier test in the same worker
that used a process pool, e.g. the verifier's scorer workers, leaves its resource tracker)."""


def sandbox_processes(commands_only: bool = False) -> list[str]:
    """Live processes descended from this one that belong to a sandbox: what a released
    session must not leave behind. ``commands_only``: leave out the sandboxes themselves
    (bubblewrap and the resident runner a warm pool keeps), count only what commands
    started."""
    found = []
    procs = descendants()
    cmdlines = {d.pid: d.cmdline for d in procs}
    for d in procs:
        if not any(k in d.cmdline for k in NOT_SANDBOX):
            if commands_only and ("bwrap" in d.cmdline or "sandbox" in d.cmdline or (
                    d.parent != os.getpid() and "bwrap" in cmdlines.get(d.parent, ""))):
                continue
            found.append(f"{d.pid} {d.cmdline[:120]}")
    return found


# --------------------------------------------------------------------------- tests


async def test_episode_runs_turn_by_turn_with_a_correct_loss_mask(
    client: RedisClient, names: N.Names, tokenizer: Any
) -> None:
    item = item_of("count_matching")
    count = fence("echo step >> log.txt; wc -l < log.txt")

    def script(turn: int, pos: int) -> str:
        # member 0 solves it at once; member 1 takes three turns; member 2 never ends it
        if turn == 1:
            return fence(solution(item)) + "\n<done>" if pos == 0 else count
        if turn == 2:
            return count
        return fence(solution(item)) + "\n<done>" if pos == 0 else fence("cat log.txt")

    engine = ScriptedEngine(tokenizer, script)
    ex = executor(turns=3)
    replicas = [Replica(Generator(engine, tokenizer), "g1"), Replica(ex, "e1"),
                Replica(Verifier(dynamic_sampling=True), "v1")]
    started = trio.current_time()
    async with trio.open_nursery() as nursery:
        for r in replicas:
            await nursery.start(r.serve, client, names)
        episode = await publish_task(client, names, item, group=3)
        traj = await trajectory(client, names)
        nursery.cancel_scope.cancel()
    elapsed = trio.current_time() - started
    # every member ended, so every session was released already (the cache is empty)
    assert len(ex.sessions) == 0 and sandbox_processes(commands_only=True) == []
    await ex.sandboxes.aclose()

    # Then one trajectory for the whole episode, with the episode's id
    assert traj.episode_id == episode and traj.rollout.task.episode is not None
    assert traj.rollout.task.episode.ended == ["done", "done", "max_turns"]
    assert traj.rewards == [1.0, 1.0, 0.0]
    assert [len(s.turns) for s in traj.rollout.samples] == [1, 3, 3]
    # the episode is counted once (the scheduler's in-flight accounting), not once per turn
    counted = {
        name: int(await client.call(client.sync.get, names.counter(name)) or 0)
        for name in ("zero_variance", "resolved:terminal", "trained:terminal")
    }
    assert counted == {"zero_variance": 0, "resolved:terminal": 1, "trained:terminal": 1}
    # the session persisted across turns: the second `wc -l` saw two lines
    member1 = traj.rollout.samples[1]
    assert member1.turns[1].observation == "exit code 0\nstdout:\n2"
    # the last turn's command ran too (then <done>); member 2's last turn hit max_turns
    assert member1.turns[2].observation == "exit code 0" and member1.text == member1.turns[2].text
    assert traj.rollout.samples[2].turns[2].observation == "exit code 0\nstdout:\nstep\nstep"
    # the engine saw the prompt, the first reply and the observation, in the chat template
    turn2_prompts = [p for t, ps in engine.calls if t == 2 for p in ps]
    prompt = bytes_to_ids(traj.rollout.prompt_ids).tolist()
    first = engine.reply_ids(count)
    assert turn2_prompts[0][: len(prompt) + len(first)] == prompt + first
    seen = tokenizer.decode(turn2_prompts[0][len(prompt) + len(first):])
    assert seen.startswith("\n<|im_start|>user\nexit code 0\nstdout:\n1<|im_end|>")
    assert seen.endswith("<|im_start|>assistant\n")

    # And the loss mask is 1 exactly on the model's tokens, which alone carry logprobs
    tokens = bytes_to_ids(member1.tokens)
    mask = np.frombuffer(member1.mask, dtype=np.uint8)
    logprobs = bytes_to_floats(member1.logprobs)
    replies = [engine.reply_ids(t.text) for t in member1.turns]
    assert tokens[mask == 1].tolist() == [i for r in replies for i in r]
    assert (logprobs[mask == 1] == LOGPROB).all() and (logprobs[mask == 0] == 0).all()
    assert 0 < int((mask == 0).sum()) < len(mask)
    assert (member1.token_versions() == 0).all() and len(member1.token_versions()) == len(mask)
    assert traj.rollout.samples[0].mask == b"\x01" * len(engine.reply_ids(script(1, 0)))
    batch = build_batch([traj], pad_id=0)
    p = len(prompt)
    assert batch.loss_mask[1, p - 1 : p - 1 + len(mask)].tolist() == mask.tolist()
    assert int(batch.loss_mask.sum()) == sum(int(np.frombuffer(s.mask, np.uint8).sum())
                                             for s in traj.rollout.samples)
    assert (batch.old_logprobs[batch.loss_mask == 0] == 0).all()

    # And with the backend closed nothing of any sandbox is left running
    assert sandbox_processes() == []
    # And replay shows every turn of every member
    shown = render_episode(Found(N.TRAJECTORIES, "0-1", "live", traj, b""))
    for s in traj.rollout.samples:
        for k, turn in enumerate(s.turns, 1):
            assert f"--- model turn {k}/{len(s.turns)}\n{turn.text}" in shown
            assert turn.observation in shown
    assert "--- episode ended: max_turns" in shown
    print(f"episode of 3 members, 7 model turns: {elapsed:.2f}s, "
          f"{7 / elapsed:.1f} member-turns/s")


async def test_replicas_killed_between_and_during_turns_lose_nothing(
    client: RedisClient, names: N.Names, tokenizer: Any
) -> None:
    item = item_of("count_matching")

    def script(turn: int, pos: int) -> str:
        return {1: fence("echo a >> log.txt"), 2: fence("echo b >> log.txt; sleep 2"),
                3: fence("cat log.txt")}.get(turn, fence(solution(item)) + "\n<done>")

    # Given generator A, which will hang on turn 3, and executor A
    engine_a = ScriptedEngine(tokenizer, script, hold_turn=3)
    engine_b = ScriptedEngine(tokenizer, script)
    ex_a, ex_b = executor(), executor()
    gen_a, gen_b = Replica(Generator(engine_a, tokenizer), "gA"), Replica(
        Generator(engine_b, tokenizer), "gB")
    exec_a, exec_b = Replica(ex_a, "eA"), Replica(ex_b, "eB")
    async with trio.open_nursery() as nursery:
        for r in (gen_a, exec_a, Replica(Verifier(), "v")):
            await nursery.start(r.serve, client, names)
        await publish_task(client, names, item, group=2)

        # When executor A is killed while turn 2's command runs (after turn 1 went through)
        async def turn2_running() -> bool:
            return exec_a.handled() == 1 and exec_a.runtime is not None and \
                exec_a.runtime.statistics().in_flight == 1

        await wait_until(turn2_running, timeout=60)

        def command_sleeping() -> bool:  # past its `echo b`: in its `sleep 2`
            return any(d.cmdline.split()[:2] == ["sleep", "2"] for d in descendants())

        await wait_until(command_sleeping, 30, what="turn 2's command did not run")
        exec_a.scope.cancel()
        await nursery.start(exec_b.serve, client, names)

        # And generator A is killed while it holds turn 3, and B takes over
        async def holding() -> bool:
            return any(t == 3 for t, _ in engine_a.calls)

        await wait_until(holding, timeout=60)
        gen_a.scope.cancel()
        await nursery.start(gen_b.serve, client, names)
        traj = await trajectory(client, names)
        nursery.cancel_scope.cancel()
    # (A released its sessions when its turn was cut; B when the members ended)
    assert len(ex_a.sessions) == len(ex_b.sessions) == 0
    for ex in (ex_a, ex_b):
        await ex.sandboxes.aclose()

    # Then the episode finished on the other replicas, from the state in the messages:
    # executor B restored both members' sessions from turn 1's snapshots and redid turn 2
    # once (log.txt holds a, b: no effect of the killed turn survived, none was doubled)
    assert traj.rewards == [1.0, 1.0]
    assert ex_b.sessions.restored == 2 and exec_b.handled() >= 2
    assert any(t == 3 for t, _ in engine_b.calls)
    for s in traj.rollout.samples:
        assert [t.observation for t in s.turns[:3]] == [
            "exit code 0", "exit code 0", "exit code 0\nstdout:\na\nb"]
    assert sandbox_processes() == []


async def test_sessions_are_released_on_every_exit_path(
    client: RedisClient, names: N.Names, tokenizer: Any
) -> None:
    item = item_of("count_matching")
    slow = fence("sleep 4")
    engine = ScriptedEngine(tokenizer, lambda turn, pos: slow)
    # Given an executor whose time limit cuts the first turn's command (cancel), every time
    ex = executor()
    gen, exe = Replica(Generator(engine, tokenizer), "g"), Replica(ex, "e", time_limit_s=1.0,
                                                                    max_retries=1)
    async with trio.open_nursery() as nursery:
        for r in (gen, exe):
            await nursery.start(r.serve, client, names)
        await publish_task(client, names, item, group=2)

        async def dead() -> bool:
            return len(await entries(client, names, N.DEAD)) == 1

        await wait_until(dead, timeout=60)
        # Then after every cancelled attempt and the dead letter, no session is held and
        # nothing a command started runs (the backend's warm sandboxes may wait, reset)
        assert len(ex.sessions) == 0 and sandbox_processes(commands_only=True) == []
        nursery.cancel_scope.cancel()
    letter = decode((await entries(client, names, N.DEAD))[0], DeadLetter)
    assert "time limit" in letter.error

    # Given episodes that ran a turn here and then moved elsewhere (or died)
    quick = ScriptedEngine(tokenizer, lambda turn, pos: fence("echo hi > f.txt"))
    idle = executor(idle_s=0.3)
    generator = Generator(quick, tokenizer)
    async with idle.sandboxes.opened():
        for _ in range(2):
            [rollout] = await generator.handle(
                make_task("terminal", item, split="train", group_size=2, sampling=Sampling(),
                          version=0))
            [cont] = await idle.handle(rollout.message)  # type: ignore[arg-type]
            assert cont.stream == N.TASKS
        assert len(idle.sessions) == 4 and len(idle.sessions.episodes()) == 2
        # When they stay idle past session_idle_s, Then the idle release closes them
        async with trio.open_nursery() as nursery:
            await nursery.start(idle.sessions.serve_idle_release)
            await wait_until(lambda: not idle.sessions, 5)
            nursery.cancel_scope.cancel()
        # And closing the executor closes what is still cached
        [rollout] = await generator.handle(make_task("terminal", item, split="train",
                                                     group_size=2, sampling=Sampling(), version=0))
        await idle.handle(rollout.message)  # type: ignore[arg-type]
        assert len(idle.sessions) == 2
        await idle.sessions.aclose()
    assert len(idle.sessions) == 0 and sandbox_processes() == []


async def docker_unavailable() -> str | None:
    try:
        async with opened(open_sandbox("docker", pool_size=0)) as box:
            await box.run(ExecRequest(["true"], limits=Limits(timeout_s=60)))
    except (ValueError, ImportError, SandboxUnavailable) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


async def test_an_episode_moves_between_executors_on_docker(tokenizer: Any) -> None:
    reason = await docker_unavailable()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the Docker backend: {reason}")
        pytest.skip(f"docker backend unavailable here: {reason}")
    item = item_of("count_matching")

    def script(turn: int, pos: int) -> str:
        return fence("echo a >> log.txt") if turn == 1 else \
            fence(f"cat log.txt && {solution(item)}") + "\n<done>"

    generator = Generator(ScriptedEngine(tokenizer, script), tokenizer)

    def on_docker() -> Executor:
        sandboxes = Sandboxes("docker", pool_size=2)
        return Executor(sandboxes, EpisodeSessions(sandboxes),
                        {"terminal": DomainConfig(max_turns=4)})

    ex_a, ex_b = on_docker(), on_docker()
    async with ex_a.sandboxes.opened(), ex_b.sandboxes.opened():
        try:
            # Given turn 1 run by executor A in Docker sessions
            [r1] = await generator.handle(make_task("terminal", item, split="train", group_size=2,
                                                    sampling=Sampling(), version=0))
            [c1] = await ex_a.handle(r1.message)  # type: ignore[arg-type]
            assert c1.stream == N.TASKS and len(ex_a.sessions) == 2
            # When executor B takes turn 2 (A still holds its cached sessions)
            [r2] = await generator.handle(c1.message)  # type: ignore[arg-type]
            [done] = await ex_b.handle(r2.message)  # type: ignore[arg-type]
            # Then B restored both members from the snapshots, saw turn 1's file, and solved it
            assert done.stream == N.EXECUTED and ex_b.sessions.restored == 2
            executed = done.message
            for sample, outcome in zip(executed.rollout.samples, executed.outcomes, strict=True):  # type: ignore[attr-defined]
                assert sample.turns[1].observation.startswith("exit code 0\nstdout:\na")
                assert TERMINAL.score(item, sample.text, from_outcome(outcome)) == 1.0
            assert len(ex_b.sessions) == 0
        finally:
            for ex in (ex_a, ex_b):
                await ex.sessions.aclose()
                await ex.sandboxes.aclose()


async def test_episode_state_that_does_not_fit_its_group_is_rejected(tokenizer: Any) -> None:
    item = item_of("count_matching")
    generator = Generator(ScriptedEngine(tokenizer, lambda t, p: fence("ls")), tokenizer)
    task = make_task("terminal", item, split="train", group_size=2, sampling=Sampling(),
                     version=0)
    [first] = await generator.handle(task)
    rollout = first.message
    ex = executor()
    async with ex.sandboxes.opened():
        try:
            # a continuation claiming one member for a group of two: dead-lettered, not guessed at
            [cont] = await ex.handle(rollout)  # type: ignore[arg-type]
            state = cont.message.episode  # type: ignore[attr-defined]
            bad = msgspec.structs.replace(cont.message, episode=msgspec.structs.replace(
                state, samples=state.samples[:1], ended=state.ended[:1]))
            with pytest.raises(Reject, match="group of 2"):
                await generator.handle(bad)
            # a multi-turn rollout without its episode state
            no_state = msgspec.structs.replace(rollout, task=msgspec.structs.replace(
                rollout.task, episode=None))  # type: ignore[attr-defined]
            with pytest.raises(Reject, match="without episode state"):
                await ex.handle(no_state)
        finally:
            await ex.sessions.aclose()


def processes_with(marker: str) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"{entry.path}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.mark.system
async def test_an_executor_process_killed_mid_turn(
    client: RedisClient, names: N.Names, redis_url: str, tokenizer: Any
) -> None:
    item = item_of("count_matching")
    marker = "2.9137"  # a command line to look for: the sleep of turn 2

    def script(turn: int, pos: int) -> str:
        return {1: fence("echo a >> log.txt"), 2: fence(f"echo b >> log.txt; sleep {marker}"),
                3: fence("cat log.txt")}.get(turn, fence(solution(item)) + "\n<done>")

    settings = {"run.name": names.run, "auth.enabled": "false",
                "scheduler.domains": '["terminal"]', "queues.block_ms": "100",
                "queues.reclaim_min_idle_ms": "1000", "queues.reclaim_interval_s": "0.3",
                "queues.heartbeat_interval_s": "0.3"}
    argv = [sys.executable, "-m", "streamrl", "run", "executor", "--config",
            "configs/tiny.toml", *[a for k, v in settings.items() for a in ("--set", f"{k}={v}")]]
    env = {"STREAMRL_REDIS_URL": redis_url, "PATH": "/usr/bin:/bin", "HOME": str(Path.home())}

    async def start_executor() -> trio.Process:
        return await trio.lowlevel.open_process(argv, env=env, cwd=REPO,
                                                stdout=subprocess.DEVNULL,
                                                stderr=subprocess.DEVNULL)

    async def pending_rollouts() -> int:
        info = await client.call(client.sync.xpending, names.stream(N.ROLLOUTS), "executor")
        return int(info["pending"])

    first = await start_executor()
    second: trio.Process | None = None
    try:
        async with trio.open_nursery() as nursery:
            for r in (Replica(Generator(ScriptedEngine(tokenizer, script), tokenizer), "g"),
                      Replica(Verifier(), "v")):
                await nursery.start(r.serve, client, names)
            await publish_task(client, names, item, group=2)

            # When the executor process is SIGKILLed while turn 2's command runs
            async def turn2_running() -> bool:
                return bool(processes_with(marker)) and await pending_rollouts() == 1

            await wait_until(turn2_running, timeout=90)
            first.kill()
            await first.wait()
            # Then its sandboxes die with it (nothing of turn 2 keeps running)
            await wait_until(lambda: not processes_with(marker), 5)
            # And another executor process finishes the episode from the messages
            second = await start_executor()
            traj = await trajectory(client, names)
            nursery.cancel_scope.cancel()
    finally:
        for proc in (first, second):
            if proc is not None and proc.returncode is None:
                proc.terminate()
                with trio.move_on_after(30):
                    await proc.wait()
                proc.kill()
    assert traj.rewards == [1.0, 1.0]
    for s in traj.rollout.samples:  # turn 2 redone once, from turn 1's snapshot
        assert s.turns[2].observation == "exit code 0\nstdout:\na\nb"


async def test_a_turn_without_a_command_keeps_the_previous_snapshot(tokenizer: Any) -> None:
    item = item_of("count_matching")
    replies = {1: fence("echo a >> log.txt"), 2: "Let me think about it first.",
               3: fence("cat log.txt") + "\n<done>"}
    generator = Generator(ScriptedEngine(tokenizer, lambda t, p: replies[t]), tokenizer)
    ex_a, ex_b = executor(), executor()
    async with ex_a.sandboxes.opened(), ex_b.sandboxes.opened():
        try:
            [r1] = await generator.handle(make_task("terminal", item, split="train", group_size=1,
                                                    sampling=Sampling(), version=0))
            [c1] = await ex_a.handle(r1.message)  # type: ignore[arg-type]
            [r2] = await generator.handle(c1.message)  # type: ignore[arg-type]
            [c2] = await ex_a.handle(r2.message)  # type: ignore[arg-type]
            # the reply without a command ran nothing and carried turn 1's snapshot over
            snaps = (c1.message.episode.snapshots, c2.message.episode.snapshots)  # type: ignore[attr-defined]
            assert snaps[0] == snaps[1] and snaps[0][0]
            assert c2.message.episode.samples[0].turns[1].observation.startswith("No command")  # type: ignore[attr-defined]
            # and another executor restores from it
            [r3] = await generator.handle(c2.message)  # type: ignore[arg-type]
            [done] = await ex_b.handle(r3.message)  # type: ignore[arg-type]
            assert ex_b.sessions.restored == 1
            last = done.message.rollout.samples[0].turns[2]  # type: ignore[attr-defined]
            assert last.observation == "exit code 0\nstdout:\na"
        finally:
            for ex in (ex_a, ex_b):
                await ex.sessions.aclose()


async def test_a_work_dir_the_model_made_read_only_is_restored(tokenizer: Any) -> None:
    # Given turn 1 on executor A: the model writes a file and makes the work dir read-only
    item = item_of("count_matching")
    replies = {1: fence("echo a >> log.txt; chmod 555 . && echo locked"),
               2: fence("cat log.txt; touch new.txt") + "\n<done>"}
    generator = Generator(ScriptedEngine(tokenizer, lambda t, p: replies[t]), tokenizer)
    ex_a, ex_b = executor(), executor()
    async with ex_a.sandboxes.opened(), ex_b.sandboxes.opened():
        try:
            [r1] = await generator.handle(make_task("terminal", item, split="train", group_size=1,
                                                    sampling=Sampling(), version=0))
            [c1] = await ex_a.handle(r1.message)  # type: ignore[arg-type]
            assert c1.message.episode.samples[0].turns[0].observation.endswith("locked")  # type: ignore[attr-defined]
            # When turn 2 goes to executor B, which restores the member from the snapshot
            [r2] = await generator.handle(c1.message)  # type: ignore[arg-type]
            [done] = await ex_b.handle(r2.message)  # type: ignore[arg-type]
            # Then it was restored (read-only as the model left it), not lost
            assert ex_b.sessions.restored == 1
            last = done.message.rollout.samples[0].turns[1].observation  # type: ignore[attr-defined]
            assert last.startswith("exit code 1\nstdout:\na\nstderr:\ntouch"), last
        finally:
            for ex in (ex_a, ex_b):
                await ex.sessions.aclose()


async def test_a_redone_turn_never_replaces_the_published_state(tokenizer: Any) -> None:
    item = item_of("count_matching")
    replies = {1: fence("head -c 6 /dev/urandom | od -An -tx1 | tr -d ' \\n' | tee f.txt"),
               2: fence("cat f.txt") + "\n<done>"}
    generator = Generator(ScriptedEngine(tokenizer, lambda t, p: replies[t]), tokenizer)
    ex = executor()
    async with ex.sandboxes.opened():
        try:
            [r1] = await generator.handle(make_task("terminal", item, split="train", group_size=1,
                                                    sampling=Sampling(), version=0))
            # Given turn 1 handled, published, then delivered again here and redone (its second
            # hand-off would be dropped by the dedup key): the cached session now holds the redo
            [published] = await ex.handle(r1.message)  # type: ignore[arg-type]
            [redone] = await ex.handle(r1.message)  # type: ignore[arg-type]
            first = published.message.episode.samples[0].turns[0].observation  # type: ignore[attr-defined]
            again = redone.message.episode.samples[0].turns[0].observation  # type: ignore[attr-defined]
            assert first != again and ex.sessions.restored == 0  # turn 1: fresh from the files
            # When turn 2 comes from the published continuation
            [r2] = await generator.handle(published.message)  # type: ignore[arg-type]
            [done] = await ex.handle(r2.message)  # type: ignore[arg-type]
            # Then the session was restored from the published snapshot, not the redo's state
            assert ex.sessions.restored == 1
            seen = done.message.rollout.samples[0].turns[1].observation  # type: ignore[attr-defined]
            assert seen.split("stdout:\n")[1] == first.split("stdout:\n")[1]
        finally:
            await ex.sessions.aclose()


async def test_the_token_budget_ends_members_and_bounds_the_context(tokenizer: Any) -> None:
    item = item_of("count_matching")
    prompt_len = len(TERMINAL.render_prompt(item, tokenizer))
    step = fence("echo step >> log.txt; wc -l < log.txt")
    engine = ScriptedEngine(tokenizer, lambda t, p: step)
    reply = len(engine.reply_ids(step))
    observation = len(chat_observation_ids(tokenizer, "exit code 0\nstdout:\n1", closed=True))
    # room for one reply, its observation and half of the second reply
    budget = prompt_len + reply + observation + reply // 2

    class Budgeted(Terminal):
        name = "terminal_budget_test"
        episode = EpisodePolicy(multi_turn=True, max_turns=20, max_total_tokens=budget)

    register("terminal_budget_test")(Budgeted)
    generator, ex = Generator(engine, tokenizer), executor(turns=20)
    task = make_task("terminal_budget_test", item, split="train", group_size=2,
                     sampling=Sampling(max_new_tokens=64), version=0)
    out = None
    async with ex.sandboxes.opened():
        try:
            for _ in range(20):  # the loop the streams run, turn by turn
                [rollout] = await generator.handle(task)
                [out] = await ex.handle(rollout.message)  # type: ignore[arg-type]
                if out.stream == N.EXECUTED:
                    break
                task = out.message  # type: ignore[assignment]
            assert out is not None and out.stream == N.EXECUTED
            executed = out.message
            ep = executed.rollout.task.episode  # type: ignore[attr-defined]
            # Then every member ended on the budget, its context never over it, and the reply
            # that did not fit was cut to the room left (finish "length"), still masked as the
            # model's
            assert ep.ended == ["budget", "budget"] and len(ex.sessions) == 0
            for s in executed.rollout.samples:  # type: ignore[attr-defined]
                assert prompt_len + len(bytes_to_ids(s.tokens)) == budget
                assert len(s.turns) == 2 and s.finish_reason == "length"
                assert int(np.frombuffer(s.mask, np.uint8).sum()) == reply + reply // 2
                assert s.turns[1].text == tokenizer.decode(engine.reply_ids(step)[: reply // 2],
                                                           skip_special_tokens=True)
        finally:
            await ex.sessions.aclose()
            registry._factories.pop("terminal_budget_test", None)  # other tests list domains
            registry._instances.pop("terminal_budget_test", None)
