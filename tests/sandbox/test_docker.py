"""The Docker backend against a real Docker engine and the offline image.

Skips (with the reason) only when no engine or image is reachable and $CI is unset; in CI
(CI=true) a missing engine or image fails the tests instead. Build the image with
``sandbox/images/build_offline.sh`` (or point $STREAMRL_SANDBOX_IMAGE at another one).
"""

from __future__ import annotations

import json
import signal
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import quote

import pytest
import trio

from streamrl.sandbox import ExecRequest, Limits, SandboxUnavailable, open_sandbox, opened
from streamrl.sandbox.docker import DockerSandbox, open_docker_sandbox
from streamrl.testing.wait import wait_until
from tests.sandbox.docker_engine import IMAGE, engine_get, require_docker

ROOT = Path(__file__).resolve().parents[2]


def _container_exists(name: str) -> bool:
    return engine_get(f"/containers/{quote(name)}/json")[0] == 200


def _runner_stopped(name: str) -> bool:
    """Whether the runner (the child of the container's init) is stopped (state T)."""
    status, body = engine_get(f"/containers/{quote(name)}/json")
    if status != 200:
        return False
    init = json.loads(body)["State"]["Pid"]
    try:
        runner = Path(f"/proc/{init}/task/{init}/children").read_text().split()[0]
        return Path(f"/proc/{runner}/stat").read_text().rpartition(")")[2].split()[0] == "T"
    except (OSError, IndexError):
        return False


@pytest.fixture(scope="module")
def docker_image() -> str:
    require_docker("Docker tests")
    return IMAGE


@pytest.fixture
async def box(docker_image: str) -> AsyncIterator[DockerSandbox]:
    async with open_docker_sandbox(docker_image, pool_size=1, host_grace_s=1.0) as sandbox:
        yield sandbox


def sh(script: str, **limits: float) -> ExecRequest:
    return ExecRequest(["/bin/sh", "-c", script], limits=Limits(**limits))  # type: ignore[arg-type]


async def test_hardening_is_visible_from_inside(box: DockerSandbox) -> None:
    result = await box.run(
        sh(
            "id -u; grep -E '^(CapEff|NoNewPrivs|Seccomp):' /proc/self/status;"
            " ls /sys/class/net; touch /etc/x 2>&1; touch /tmp/x && /tmp/x 2>&1; echo end"
        )
    )
    out = result.stdout.decode()
    lines = out.splitlines()
    assert lines[0] == "65534"
    assert "CapEff:\t0000000000000000" in out
    assert "NoNewPrivs:\t1" in out
    assert "Seccomp:\t2" in out  # Docker's default seccomp profile is on
    assert lines[4] == "lo"  # the only network interface
    assert "Read-only file system" in out
    assert "Permission denied" in out  # /tmp is noexec
    assert lines[-1] == "end"


async def test_exit_code_and_output_are_data(box: DockerSandbox) -> None:
    result = await box.run(
        ExecRequest(
            ["python3", "-c", "import sys; print(sys.stdin.read()[::-1]); sys.exit(3)"],
            files={"pkg/data.txt": b"x"},
            stdin=b"olleh",
        )
    )
    assert (result.exit_code, result.stdout, result.timed_out, result.oom_killed) == (
        3,
        b"hello\n",
        False,
        False,
    )
    missing = await box.run(ExecRequest(["/no/such/binary"]))
    assert missing.exit_code == 127
    assert b"not found" in missing.stderr


async def test_timeout_is_data_and_fast(box: DockerSandbox) -> None:
    result = await box.run(sh("echo started; sleep 30", timeout_s=0.5))
    assert result.timed_out and result.exit_code is None
    assert result.stdout == b"started\n"
    assert result.duration_s < 2.0


async def test_oom_is_data(box: DockerSandbox) -> None:
    code = "b = []\nwhile True: b.append(bytearray(16 << 20))"
    result = await box.run(ExecRequest(["python3", "-c", code], limits=Limits(memory_mb=64)))
    assert result.oom_killed
    assert result.exit_code == 128 + signal.SIGKILL
    assert not result.timed_out


async def test_output_is_truncated_and_counted(box: DockerSandbox) -> None:
    result = await box.run(
        sh("head -c 3000000 /dev/zero; head -c 10 /dev/zero >&2", output_bytes=1 << 20)
    )
    assert result.exit_code == 0
    assert len(result.stdout) == 1 << 20
    assert result.stdout_dropped == 3_000_000 - (1 << 20)
    assert (len(result.stderr), result.stderr_dropped) == (10, 0)


async def test_session_files_persist_across_runs_and_vanish_after_reset(
    box: DockerSandbox,
) -> None:
    async with box.session(Limits(), label="msg-1234/5") as session:
        assert session.container_name is not None
        assert session.container_name.startswith("streamrl-msg-1234_5-")
        assert _container_exists(session.container_name)
        await session.put_files({"a/in.txt": b"41"})
        first = await session.run(sh("echo $(( $(cat a/in.txt) + 1 )) > out.txt; ls /tmp"))
        assert first.exit_code == 0
        second = await session.run(sh("cat out.txt; touch /tmp/t /dev/shm/s"))
        assert second.stdout == b"42\n"
        assert await session.get_files(["out.txt", "nope"]) == {"out.txt": b"42\n", "nope": None}

        await session.reset()
        after = await session.run(sh("ls -A /work /tmp /dev/shm"))
        assert after.stdout.split() == [b"/dev/shm:", b"/tmp:", b"/work:"]
        assert await session.get_files(["out.txt"]) == {"out.txt": None}
        name = session.container_name
    await wait_until(  # back in the pool, under its pool name again
        lambda: not _container_exists(name) and box.statistics().ready >= 1, timeout=5
    )


async def test_two_executors_name_sessions_of_one_label_apart(
    box: DockerSandbox, docker_image: str
) -> None:
    """Two executors on one engine (replicas on one host) may hold sessions with the same
    label (an episode member moved between them): their container names must not collide."""
    async with (
        open_docker_sandbox(docker_image, pool_size=1, host_grace_s=1.0) as other,
        box.session(Limits(), label="ep-1/0") as one,
        other.session(Limits(), label="ep-1/0") as two,
    ):
        assert one.container_name and two.container_name
        assert one.container_name != two.container_name
        assert (await one.run(sh("echo one"))).stdout == b"one\n"
        assert (await two.run(sh("echo two"))).stdout == b"two\n"


async def _names_with(fragment: str) -> list[str]:
    """Names of the engine's containers (any state) that contain ``fragment`` (asked in a
    thread: the sandbox's engine calls run on this trio loop)."""
    query = "/containers/json?all=1&filters=" + quote(json.dumps({"name": [fragment]}))
    status, body = await trio.to_thread.run_sync(engine_get, query)
    assert status == 200, body
    return [n.lstrip("/") for c in json.loads(body) for n in c["Names"] if fragment in n]


async def _renames(instance: str, since: float) -> list[str]:
    """The names the engine renamed containers of backend ``instance`` to since ``since``
    (its event log, up to now)."""
    filters = json.dumps(
        {"type": ["container"], "event": ["rename"], "label": [f"streamrl.instance={instance}"]}
    )
    query = f"/events?since={since:.6f}&until={time.time():.6f}&filters={quote(filters)}"
    status, body = await trio.to_thread.run_sync(engine_get, query)
    assert status == 200, body
    return [json.loads(line)["Actor"]["Attributes"]["name"] for line in body.splitlines() if line]


async def _watch_for(fragment: str, seen: list[str]) -> None:
    while not seen:
        seen.extend(await _names_with(fragment))
        await trio.sleep(0.05)


async def test_a_one_shot_run_is_named_after_its_label_while_it_runs(box: DockerSandbox) -> None:
    # Given a warm pool, and a one-shot run labelled with a message id
    await box.run(sh("true"))
    await wait_until(lambda: (s := box.statistics()).ready >= 1 and not s.busy, 10)
    before, since = box.statistics(), time.time()
    label = f"msg-{uuid.uuid4().hex}-0"
    seen: list[str] = []
    # When the engine is watched while the run executes
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_watch_for, label, seen)
        result = await box.run(sh("sleep 1.5; echo done", timeout_s=10), label=label)
        during = list(seen)
        nursery.cancel_scope.cancel()
    # Then its container was found by the message id while it ran
    assert result.stdout == b"done\n"
    assert len(during) == 1 and during[0].startswith(f"streamrl-{label}-{box.instance}-"), during
    # And after it, no container carries the id: the container is back in the pool under its
    # neutral name, or removed (a surplus one: the pool's filler may have raced the warm-up)

    async def none_named() -> bool:
        return not await _names_with(label) and not box.statistics().busy

    await wait_until(none_named, timeout=5)
    assert box.statistics().reused == before.reused + 1  # a pooled container served the run
    renames = await _renames(box.instance, since)
    assert renames[0] == during[0], renames
    if len(renames) > 1:  # renamed back, under the name it had in the pool
        assert len(renames) == 2 and renames[1].startswith(f"streamrl-sbx-{box.instance}-")
        assert await _names_with(renames[1]) == [renames[1]]
    else:
        assert box.statistics().removed > before.removed


async def test_a_short_one_shot_run_costs_no_rename(box: DockerSandbox) -> None:
    # Given a warm pool
    await box.run(sh("true"))
    since = time.time()
    # When labelled runs end before name_runs_after_s (0.2 s)
    for i in range(3):
        result = await box.run(sh("echo quick"), label=f"msg-quick-{i}")
        assert result.stdout == b"quick\n"
    await trio.sleep(0.5)  # past the delay: a rename not called off would have happened
    # Then the engine renamed nothing: no engine call was added to them
    assert await _renames(box.instance, since) == []


async def test_the_executor_connects_afresh_once_an_unreachable_engine_is_back(
    docker_image: str, tmp_path: Path
) -> None:
    # Given an executor whose Docker engine (its socket proxy, as in the compose cluster) is
    # not there yet
    from streamrl.actors.executor import Sandboxes
    from streamrl.config.schema import DomainConfig, DomainSandboxConfig
    from streamrl.domains.registry import get_domain
    from streamrl.sandbox.socket_proxy import Policy, Proxy, serve_proxy
    from tests.actors.test_executor import _program
    from tests.sandbox.docker_engine import SOCKET

    path = tmp_path / "docker.sock"

    def opener(backend: str, **options: object) -> DockerSandbox:
        return DockerSandbox(docker_url=f"unix://{path}", host_grace_s=1.0, **options)  # type: ignore[arg-type]

    config = {"arith": DomainSandboxConfig(backend="docker", image=docker_image, pool_size=1)}
    sandboxes = Sandboxes("process", config, {"arith": DomainConfig(timeout_s=10)}, opener=opener)
    arith = get_domain("arith")
    request = arith.exec_request(arith.load_items("eval")[0], _program("print(6 * 7)"))
    assert request is not None
    async with sandboxes.opened():
        # When a run is tried before the engine is reachable, then again once it is
        with pytest.raises(SandboxUnavailable, match="unreachable") as refused:
            await sandboxes.run(arith, request)
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_proxy, f"unix:{path}", Proxy(SOCKET, Policy()))
            result = await sandboxes.run(arith, request)
            nursery.cancel_scope.cancel()
    # Then the refusal carried the connection's own error
    assert refused.value.__cause__ is not None
    # Then the retry got a fresh backend that connected, not the first one's failure kept
    assert result.ok and result.stdout == b"42\n"


async def test_an_engine_lost_while_a_command_runs_raises_into_the_caller(
    docker_image: str, tmp_path: Path
) -> None:
    # Given the executor's sandboxes (opened in their nursery) on a Docker engine reached
    # through its socket proxy, as in the compose cluster, and a rollout whose program runs long
    from streamrl.actors.executor import Executor, Sandboxes
    from streamrl.config.schema import DomainConfig, DomainSandboxConfig
    from streamrl.runtime.policies import Unavailable
    from streamrl.sandbox.runner_channel import RunnerGone
    from streamrl.sandbox.socket_proxy import Policy, Proxy, serve_proxy
    from streamrl.testing.wait import wait_until
    from tests.actors.test_executor import _program, _rollout
    from tests.sandbox.docker_engine import SOCKET

    path, made = tmp_path / "docker.sock", []

    def opener(backend: str, **options: object) -> DockerSandbox:
        made.append(DockerSandbox(docker_url=f"unix://{path}", host_grace_s=1.0, **options))  # type: ignore[arg-type]
        return made[-1]

    config = {"arith": DomainSandboxConfig(backend="docker", image=docker_image, pool_size=1)}
    sandboxes = Sandboxes("process", config, {"arith": DomainConfig(timeout_s=30)}, opener=opener)
    rollout = _rollout(_program("import time; time.sleep(6)"))
    engine = trio.CancelScope()

    async def proxy(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with engine:
            await serve_proxy(f"unix:{path}", Proxy(SOCKET, Policy()), task_status=task_status)

    async with trio.open_nursery() as outer:
        await outer.start(proxy)
        async with sandboxes.opened():
            async with trio.open_nursery() as nursery:
                caught: list[BaseException] = []

                async def handle() -> None:
                    try:
                        await Executor(sandboxes).handle(rollout)
                    except Unavailable as exc:
                        caught.append(exc)

                nursery.start_soon(handle)
                # When the engine connection fails while the sample's command runs
                await wait_until(lambda: _names_with(rollout.id), timeout=30)
                start = time.monotonic()
                engine.cancel()
            # Then the call in flight raised (Unavailable, for the runtime's retry policy),
            # soon, chained to the backend's failure and to the lost connection itself
            assert time.monotonic() - start < 5
            [unavailable] = caught
            assert isinstance(unavailable.__cause__, SandboxUnavailable), unavailable
            assert "Docker sandbox stopped" in str(unavailable.__cause__)
            assert isinstance(unavailable.__cause__.__cause__, RunnerGone)
            # And a later call on that backend raises it too, and the backend is stopped
            [backend] = made
            assert backend.stopped
            with pytest.raises(SandboxUnavailable, match="stopped") as later:
                await backend.run(ExecRequest(["true"]))
            assert later.value.__cause__ is unavailable.__cause__.__cause__
    # And once the sandboxes' nursery closed, no container of that backend is left
    async def none_left() -> bool:
        return not await _names_with(backend.instance)

    await wait_until(none_left, timeout=30, interval=0.5)


async def test_the_executor_names_a_samples_container_after_the_message(
    docker_image: str,
) -> None:
    # Given the executor on the Docker backend and a rollout whose program runs for a while
    from streamrl.actors.executor import Executor, Sandboxes
    from streamrl.config.schema import DomainConfig, DomainSandboxConfig
    from tests.actors.test_executor import _program, _rollout

    config = {"arith": DomainSandboxConfig(backend="docker", image=docker_image, pool_size=1)}
    sandboxes = Sandboxes("process", config, {"arith": DomainConfig(timeout_s=10)})
    rollout = _rollout(_program("import time; time.sleep(1.5); print(7)"))
    seen: list[str] = []
    # When it handles the message while the engine is watched for the message id
    async with sandboxes.opened(), trio.open_nursery() as nursery:
        nursery.start_soon(_watch_for, rollout.id, seen)
        [output] = await Executor(sandboxes).handle(rollout)
        during = list(seen)
        nursery.cancel_scope.cancel()
    # Then the sample's container carried the message id (and the sample's index) as it ran
    assert output.message.outcomes[0].stdout == "7\n"  # type: ignore[attr-defined]
    assert len(during) == 1 and during[0].startswith(f"streamrl-{rollout.id}-0-"), during
    # And no container of it outlives the executor's sandboxes
    assert await _names_with(rollout.id) == []


async def test_nothing_survives_a_command_and_the_pool_reuses_containers(
    box: DockerSandbox,
) -> None:
    for _ in range(5):
        result = await box.run(
            sh(
                "ls -A /work /tmp; for p in /proc/[0-9]*/comm; do read c < $p; echo $c; done;"
                " echo x > f; sleep 60 & (sleep 60 &)"
            )
        )
        # Nothing left by the previous run: empty dirs; processes: init, the runner, this sh.
        listed = result.stdout.split()
        assert listed[:2] == [b"/tmp:", b"/work:"], result
        assert sorted(listed[2:]) == [b"docker-init", b"python3", b"sh"], result
        await trio.sleep(0.05)  # let the background reset finish
    stats = box.statistics()
    assert stats.created <= 2  # one container (a second only if the first run raced the filler)
    assert stats.reused >= 4


async def test_host_deadline_removes_a_container_whose_runner_is_stuck(
    box: DockerSandbox,
) -> None:
    # The code stops its own runner (same uid): only the host deadline can end this run.
    async with box.session(Limits(timeout_s=1.0)) as session:
        name = session.container_name
        assert name is not None
        start = time.monotonic()
        result = await session.run(sh("kill -STOP $PPID; sleep 30", timeout_s=1.0))
        assert result.timed_out and result.exit_code is None
        assert b"host deadline" in result.stderr
        assert time.monotonic() - start < 5.0
        assert not _container_exists(name)
        with pytest.raises(SandboxUnavailable):
            await session.run(sh("true"))
        await session.reset()  # a fresh container
        assert (await session.run(sh("echo back"))).stdout == b"back\n"


async def test_a_killed_runner_costs_the_run_not_the_sandbox(box: DockerSandbox) -> None:
    result = await box.run(sh("kill -KILL $PPID; sleep 5"))
    assert (result.exit_code, result.timed_out) == (None, False)
    assert b"runner exited" in result.stderr
    assert (await box.run(sh("echo next"))).stdout == b"next\n"  # another container


async def test_a_forged_reply_is_detected(box: DockerSandbox) -> None:
    # The code writes a well-formed "success" frame into the container's stdout via init's fd.
    reply = {"exit_code": 0, "timed_out": False, "oom": False, "duration_s": 0.0, "out_n": 3}
    fake = json.dumps({**reply, "out_dropped": 0, "err_dropped": 0, "id": "guess", "n": 3})
    frame = struct.pack(">I", len(fake)) + fake.encode() + b"42\n"
    code = f"open('/proc/1/fd/1', 'wb').write({frame!r}); import time; time.sleep(1)"
    result = await box.run(ExecRequest(["python3", "-c", code]))
    assert (result.exit_code, result.stdout) == (None, b"")
    assert b"forged" in result.stderr
    assert box.statistics().removed == 1  # that container is never reused


async def test_orphans_of_a_dead_executor_are_reaped(docker_image: str, tmp_path: Path) -> None:
    # Given an executor process holding a container whose runner it stopped (so stdin EOF
    # cannot end it) and an idle pool container, killed with SIGKILL.
    script = tmp_path / "executor.py"
    script.write_text(
        "import sys, trio\n"
        "from streamrl.sandbox import ExecRequest, Limits\n"
        "from streamrl.sandbox.docker import open_docker_sandbox\n"
        "async def main():\n"
        f"  async with open_docker_sandbox({docker_image!r}, pool_size=2) as box:\n"
        "    async with box.session(Limits(), label='orphan') as s:\n"
        "        print('NAME=' + s.container_name, flush=True)\n"
        "        await s.run(ExecRequest(['sh', '-c', 'kill -STOP $PPID'],"
        " limits=Limits(timeout_s=60)))\n"
        "trio.run(main)\n"
    )
    child = subprocess.Popen(
        [sys.executable, str(script)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        line = ""
        while not line.startswith("NAME="):  # (structlog writes to stdout too)
            line = await trio.to_thread.run_sync(child.stdout.readline)
            assert line, "the executor process ended early"
        name = line.strip().removeprefix("NAME=")
        assert name.startswith("streamrl-orphan-")
        # the run starts and the runner stops itself
        await wait_until(lambda: _runner_stopped(name), timeout=20, interval=0.1)
    finally:
        child.kill()
        child.wait()
        if child.stdout is not None:
            child.stdout.close()
    assert _container_exists(name)

    # When a new executor starts, it reaps what the dead one left.
    async with open_docker_sandbox(docker_image, pool_size=0, reap_at_start=False) as survivor:
        removed = await survivor.reap_orphans()

    # Then the stuck container is gone; the idle one ended itself when its stdin closed.
    assert name in removed
    assert not _container_exists(name)
    status, body = engine_get(
        "/containers/json?all=1&filters=" + quote(json.dumps({"label": ["streamrl.sandbox"]}))
    )
    # (a container being removed has no name and state "removing": it is not left over)
    leftovers = [c["Names"] for c in json.loads(body) if c.get("State") != "removing"]
    assert status == 200 and not [n for n in leftovers if any("orphan" in x for x in n)], leftovers


async def test_open_sandbox_registry_runs_docker(docker_image: str) -> None:
    async with opened(open_sandbox("docker", image=docker_image, pool_size=1)) as sandbox:
        result = await sandbox.run(ExecRequest(["python3", "-c", "print(1)"]))
    assert (sandbox.name, result.exit_code, result.stdout) == ("docker", 0, b"1\n")


async def test_engine_down_is_sandbox_unavailable(tmp_path: Path) -> None:
    url = f"unix://{tmp_path}/no-docker.sock"
    async with open_docker_sandbox(docker_url=url, pool_size=1) as sandbox:
        with pytest.raises(SandboxUnavailable, match="Docker engine unreachable") as refused:
            await sandbox.run(ExecRequest(["true"]))
    assert refused.value.__cause__ is not None  # the connection's own error, chained
    assert sandbox.stopped


async def test_an_unserved_sandbox_is_a_programming_error() -> None:
    with pytest.raises(RuntimeError, match="not served"):
        await DockerSandbox().run(ExecRequest(["true"]))


async def test_a_run_cancelled_at_any_point_leaves_no_container(docker_image: str) -> None:
    # Given runs cancelled at points spread over create, attach, start and the command itself
    instances = []
    for delay in (0.0, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.4):
        async with open_docker_sandbox(docker_image, pool_size=0, reap_at_start=False) as box:
            instances.append(box.instance)
            with trio.move_on_after(delay):
                await box.run(ExecRequest(["python3", "-c", "print(1)"]))
    # Then none of their containers exists any more, started or not
    status, body = engine_get("/containers/json?all=1")
    names = [n for c in json.loads(body) for n in c["Names"]]
    assert status == 200
    assert not [n for n in names for i in instances if f"streamrl-sbx-{i}-" in n], names



async def test_no_container_is_left_once_aclose_returns(docker_image: str) -> None:
    """``aclose`` returns once the engine lists none of the backend's containers: those it
    used (their removal waits for the engine, which may still be auto-removing one), and one
    the engine made although its create's answer never came back (made here by hand)."""
    for _ in range(2):
        names = []
        async with open_docker_sandbox(docker_image, pool_size=2) as sandbox:
            for label in ("a", "b", "c"):
                async with sandbox.session(Limits(), label=f"left-{label}") as session:
                    assert (await session.run(sh("echo x > f"))).ok
                    assert session.container_name is not None
                    names.append(session.container_name)
            lost = f"streamrl-lost-{sandbox.instance}"
            subprocess.run(
                ["docker", "create", "--name", lost, "--network", "none",
                 "--label", "streamrl.sandbox=1", "--label",
                 f"streamrl.instance={sandbox.instance}", docker_image, "true"],
                check=True, capture_output=True, timeout=60,
            )  # fmt: skip
            names.append(lost)
        # Then, as soon as the sandbox is closed, the engine lists none of them
        assert [name for name in names if _container_exists(name)] == []
