"""The executor actor: real sandboxes (the process backend), per-domain backend choice, and a
sandbox outage that becomes a retry of the whole message (against a real Redis), not a dead
letter."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import uuid
from pathlib import Path
from typing import Any

import msgspec
import psutil
import pytest
import trio

from streamrl.actors.executor import Executor, Sandboxes
from streamrl.config.schema import DomainConfig, DomainSandboxConfig, ExecutorConfig
from streamrl.domains.registry import get_domain
from streamrl.protocol import names as N
from streamrl.protocol.messages import Executed, Rollout, Sample, Sampling, Task, new_id, now
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import decode, encode
from streamrl.queues.streams import FIELD, ConsumerSettings, Producer, open_stream_consumer
from streamrl.runtime.policies import Policies, Retry, RetryPolicy
from streamrl.runtime.serve import ActorRuntime, RuntimeSettings
from streamrl.sandbox import ProcessSandbox, Sandbox, open_sandbox
from streamrl.testing.wait import wait_until


def _rollout(*texts: str) -> Rollout:
    item = get_domain("arith").load_items("eval")[0]
    task = Task(
        id=new_id(), created_at=now(), policy_version=0, domain="arith", item_id=item.id,
        split="eval", prompt=item.prompt, spec=msgspec.to_builtins(item),
        group_size=len(texts), sampling=Sampling(),
    )  # fmt: skip
    samples = [
        Sample(tokens=b"", logprobs=b"", text=t, finish_reason="stop", weight_version=0)
        for t in texts
    ]
    return Rollout(id=new_id(), created_at=now(), policy_version=0, task=task,
                   prompt_ids=b"", samples=samples)  # fmt: skip


def _program(code: str) -> str:
    return f"```python\n{code}\n```"


async def test_outcomes_of_a_group_are_data() -> None:
    # Given a group: a good program, a crash, a hang, and no program at all
    rollout = _rollout(
        _program("print(6 * 7)"), _program("raise SystemExit(3)"), _program("while True: pass"), ""
    )
    sandboxes = Sandboxes("process", limits={"arith": DomainConfig(timeout_s=0.5)})
    # When the executor handles it
    async with sandboxes.opened():
        [output] = await Executor(sandboxes).handle(rollout)
    # Then every sample has an outcome, in order, and the hang was cut at 0.5 s
    assert output.stream == N.EXECUTED and isinstance(output.message, Executed)
    good, crash, hang, empty = output.message.outcomes
    assert (good.exit_code, good.stdout) == (0, "42\n")
    assert crash.exit_code == 3 and not crash.timed_out
    assert hang.timed_out and hang.exit_code is None and hang.duration_s < 2.5
    assert empty.exit_code is None and empty.duration_s == 0.0


async def test_backend_and_limits_are_chosen_per_domain() -> None:
    opened: list[tuple[str, dict[str, Any]]] = []

    def opener(backend: str, **options: Any) -> Sandbox:
        opened.append((backend, options))
        return open_sandbox(backend)

    arith = get_domain("arith")
    request = arith.exec_request(arith.load_items("eval")[0], _program("print(1)"))
    assert request is not None
    # Given the config gives arith a backend, an image and tighter limits
    config = {"arith": DomainSandboxConfig(backend="process", image="img:1")}
    limits = {"arith": DomainConfig(timeout_s=0.25, memory_mb=64)}
    sandboxes = Sandboxes("docker", config, limits, opener=opener)
    # When its requests are routed
    backend, image, routed = sandboxes.choose(arith, request)
    async with sandboxes.opened():
        result = await sandboxes.run(arith, request)
        await sandboxes.run(arith, request)
    # Then the config wins over executor.backend, and one backend serves both runs
    assert (backend, image) == ("process", "img:1")
    assert opened == [("process", {"image": "img:1", "pool_size": 4})]
    assert routed.limits.timeout_s == 0.25 and routed.limits.memory_mb == 64
    assert routed.limits.cpu_s == 1 and routed.files == request.files
    assert result.ok and result.stdout == b"1\n"
    # And without config the domain's spec / executor.backend decide, with its own limits
    assert Sandboxes("process").choose(arith, request)[::2] == ("process", request)


async def test_pool_size_reaches_pooled_backends_per_domain() -> None:
    opened: list[tuple[str, dict[str, Any]]] = []

    def opener(backend: str, **options: Any) -> Sandbox:
        opened.append((backend, options))
        return open_sandbox("process")  # routing under test, not the container backend

    arith = get_domain("arith")
    request = arith.exec_request(arith.load_items("eval")[0], _program("print(1)"))
    assert request is not None
    # Given docker for arith with its own pool size, over an executor-wide default
    config = {"arith": DomainSandboxConfig(backend="docker", image="img:2", pool_size=12)}
    sandboxes = Sandboxes("process", config, opener=opener, pool_size=3)
    async with sandboxes.opened():
        await sandboxes.run(arith, request)
    assert opened == [("docker", {"image": "img:2", "pool_size": 12})]
    # And the executor-wide size where the domain sets none
    opened.clear()
    plain = {"arith": DomainSandboxConfig(backend="docker", image="img:2")}
    sandboxes = Sandboxes("process", plain, opener=opener, pool_size=3)
    async with sandboxes.opened():
        await sandboxes.run(arith, request)
    assert opened == [("docker", {"image": "img:2", "pool_size": 3})]
    # And the process backend's resident sandboxes are pooled the same way
    opened.clear()
    sandboxes = Sandboxes("process", {}, opener=opener, pool_size=5)
    async with sandboxes.opened():
        await sandboxes.run(arith, request)
    assert opened == [("process", {"pool_size": 5})]


def test_unknown_backend_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="known backends"):
        ExecutorConfig(domains={"arith": DomainSandboxConfig(backend="teapot")})
    with pytest.raises(ValueError, match="known backends"):
        ExecutorConfig(backend="teapot")


async def test_sandbox_unavailable_asks_for_a_retry(tmp_path: Path) -> None:
    # Given a backend whose work dirs cannot be created (an infrastructure failure; host work
    # dirs are used without resident sandboxes, whose work dir is a tmpfs inside the sandbox)
    missing = tmp_path / "gone"

    def opener(backend: str, **options: Any) -> Sandbox:
        return ProcessSandbox(tmp_dir=str(missing), resident=False)

    sandboxes = Sandboxes("process", opener=opener)
    # When the executor handles a group, Then it asks for the whole message to be retried
    async with sandboxes.opened():
        with pytest.raises(Retry, match="sandbox unavailable"):
            await Executor(sandboxes).handle(_rollout(_program("print(1)"), _program("print(2)")))


async def test_outage_is_retried_by_the_runtime_then_published(
    client: RedisClient, names: N.Names
) -> None:
    # Given a rollout on the stream and a sandbox that is down until the dir appears
    base = Path(tempfile.mkdtemp(prefix="streamrl-test-exec-"))
    base.chmod(0o711)  # the sandbox uid must reach its work dir
    missing = base / "later"
    sandboxes = Sandboxes(
        "process", opener=lambda b, **o: ProcessSandbox(tmp_dir=str(missing), resident=False)
    )
    await Producer(client, names).publish(N.ROLLOUTS, [encode(_rollout(_program("print(5)")))])
    policies = Policies(retry=RetryPolicy(max_retries=20, backoff_s=0.05, max_backoff_s=0.2))
    settings = ConsumerSettings(block_ms=50)
    async with sandboxes.opened(), open_stream_consumer(
        client, names, N.ROLLOUTS, stage="executor", settings=settings
    ) as consumer:
        runtime = ActorRuntime(consumer, Executor(sandboxes), policies, RuntimeSettings())
        async with trio.open_nursery() as nursery:
            await nursery.start(runtime.serve)
            # When the first attempts fail and then the infrastructure comes back
            await wait_until(lambda: runtime.statistics().retried >= 2, 20)
            missing.mkdir()
            await wait_until(lambda: runtime.statistics().handled >= 1, 20)
            nursery.cancel_scope.cancel()
    shutil.rmtree(base)
    # Then the message was published once, with the program's output, and not dead-lettered
    stats = runtime.statistics()
    assert stats.dead_lettered == 0 and stats.retried >= 2
    entries = await client.call(client.sync.xrange, names.stream(N.EXECUTED))
    [executed] = [decode(fields[FIELD], Executed) for _, fields in entries]
    assert executed.outcomes[0].stdout == "5\n", executed.outcomes


def _runner_of(tag: str) -> int | None:
    """The host pid of the runner whose command carries ``tag`` (its parent), or None."""
    for proc in psutil.process_iter(["cmdline"]):
        if tag in " ".join(proc.info["cmdline"] or []):
            return proc.ppid()
    return None


async def test_a_runner_killed_mid_run_is_retried_not_lost(
    client: RedisClient, names: N.Names
) -> None:
    # Given the executor's opened sandboxes (resident bwrap sandboxes where they work) and a
    # rollout whose program re-executes itself under a marker, then takes a while
    tag = f"sbxmark-{uuid.uuid4().hex}"
    program = (
        "import os, sys, time\n"
        f"if len(sys.argv) < 2: os.execv(sys.executable, [sys.executable, __file__, {tag!r}])\n"
        "time.sleep(1.0)\n"
        "print(5)"
    )
    await Producer(client, names).publish(N.ROLLOUTS, [encode(_rollout(_program(program)))])
    policies = Policies(retry=RetryPolicy(max_retries=5, backoff_s=0.05, max_backoff_s=0.2))
    sandboxes = Sandboxes("process", limits={"arith": DomainConfig(timeout_s=20)})
    async with sandboxes.opened(), open_stream_consumer(
        client, names, N.ROLLOUTS, stage="executor", settings=ConsumerSettings(block_ms=50)
    ) as consumer:
        runtime = ActorRuntime(consumer, Executor(sandboxes), policies, RuntimeSettings())
        async with trio.open_nursery() as nursery:
            await nursery.start(runtime.serve)
            # When the runner of the first attempt is killed while the command runs
            runner = await wait_until(lambda: _runner_of(tag), 20)
            os.kill(runner, signal.SIGKILL)
            # Then the message is retried (the executor keeps serving) and then published
            await wait_until(lambda: runtime.statistics().handled >= 1, 30)
            nursery.cancel_scope.cancel()
    stats = runtime.statistics()
    assert stats.retried == 1 and stats.dead_lettered == 0, stats
    entries = await client.call(client.sync.xrange, names.stream(N.EXECUTED))
    [executed] = [decode(fields[FIELD], Executed) for _, fields in entries]
    assert executed.outcomes[0].stdout == "5\n", executed.outcomes
