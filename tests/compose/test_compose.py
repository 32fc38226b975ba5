"""The compose cluster for real: Debian's docker-compose 1.29 runs compose.yaml with the
host-network override (compose.host.yaml) and the cpu profile (serve-model, tiny model).

Given a cluster with 2 generators, 1 executor and 2 verifiers (each its own container, its own
Redis ACL user, the executor behind the Docker socket proxy), when training runs the test
scales the executor to 3 (and measures how long the new replicas take to handle their first
message), then ``docker kill``s a generator and a verifier; then training continues, every
admitted group is trained, dropped as stale or dead-lettered, nothing stays pending, and
``down -v`` leaves no container, volume or network of the project (nor a sandbox container of
its executors).

Needs docker-compose, a Docker engine and the offline images (``docker/build_offline.sh``;
.ci/run builds them). Skips with the reason without them, except under $CI, where it fails.
Figures go to stdout and to ``runs/compose-test.json``.
"""

from __future__ import annotations

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
from pathlib import Path
from typing import Any

import pytest
import redis

from queues import names as N
from queues.messages import (
    DeadLetter,
    Executed,
    Rollout,
    StepMetrics,
    Task,
    WeightsPublished,
    decode,
)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
IMAGE = os.environ.get("STREAMRL_IMAGE", "streamrl:offline")
SANDBOX_IMAGE = "streamrl-sandbox:offline"
COMPOSE = os.environ.get("STREAMRL_COMPOSE", "docker-compose").split()
CONFIG = ROOT / "configs" / "compose-host.toml"
ROLES = ("SCHEDULER", "GENERATOR", "EXECUTOR", "VERIFIER", "LEARNER", "MONITOR", "ARCHIVER")
PIPELINE = (N.TASKS, N.ROLLOUTS, N.EXECUTED, N.TRAJECTORIES)


def _why_not() -> str | None:
    if shutil.which(COMPOSE[0]) is None:
        return f"{COMPOSE[0]} is not installed (apt-get install docker-compose)"
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        return "no Docker engine (dockerd --bridge=none --iptables=false)"
    for image in (IMAGE, SANDBOX_IMAGE):
        if subprocess.run(["docker", "image", "inspect", image], capture_output=True).returncode:
            return f"image {image} missing: run docker/build_offline.sh"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Cluster:
    project: str
    env: dict[str, str]
    redis: redis.Redis
    names: N.Names
    figures: dict[str, Any] = field(default_factory=dict)

    def compose(self, *args: str, timeout: float = 180) -> str:
        argv = [*COMPOSE, "-p", self.project, "-f", "compose.yaml", "-f", "compose.host.yaml",
                "--profile", "cpu", *args]  # fmt: skip
        done = subprocess.run(argv, cwd=ROOT, env=self.env, capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip
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

    def groups(self) -> dict[str, tuple[int, int]]:
        """stream -> (lag, pending) of its work group."""
        out = {}
        for stream in N.WORK_STREAMS:
            try:
                for g in self.redis.xinfo_groups(self.names.stream(stream)):
                    out[stream] = (int(g.get("lag") or 0), int(g["pending"]))
            except redis.ResponseError:
                out[stream] = (0, 0)
        return out

    def ledger(self) -> dict[str, int]:
        """Admitted training groups and what became of them."""
        trained = sum(
            decode(f[b"d"], StepMetrics).groups
            for _, f in self.redis.xrange(self.names.stream(N.METRICS))
        )
        dead_train = 0
        for _, f in self.redis.xrange(self.names.stream(N.DEAD)):
            letter = decode(f[b"d"], DeadLetter)
            if _split(letter) != "eval":
                dead_train += 1
        return {
            "admitted": int(self.redis.get(self.names.admitted) or 0),
            "trained": trained,
            "dropped_stale": int(self.redis.get(self.names.counter("dropped_stale")) or 0),
            "dead_letters": dead_train,
        }


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
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    state = f"ledger {cluster.ledger()}, (lag, pending) {cluster.groups()}"
    raise AssertionError(
        f"timed out after {timeout_s} s waiting for {what}: {state}\n{cluster.logs()}"
    )


def _first_event(container: str, event: str) -> float | None:
    """Wall time of the first ``event`` log line of a container (structlog JSON, UTC)."""
    out = subprocess.run(["docker", "logs", container], capture_output=True, text=True).stderr
    for line in out.splitlines():
        if f'"event": "{event}"' in line:
            return datetime.fromisoformat(json.loads(line)["timestamp"]).timestamp()
    return None


def _executor_owners(cluster: Cluster) -> set[str]:
    """``host~pidns`` of every executor container: the owner label of its sandboxes."""
    owners = set()
    host = socket.gethostname()
    for cid in cluster.containers("executor", all_=True).values():
        pid = _docker("inspect", "-f", "{{.State.Pid}}", cid).strip()
        if pid and pid != "0":
            owners.add(f"{host}~{os.stat(f'/proc/{pid}/ns/pid').st_ino}")
    return owners


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    reason = _why_not()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"the compose test must run in CI: {reason}")
        pytest.skip(reason)
    redis_port, serve_port = _free_port(), _free_port()
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
    c = Cluster(project, env, client, N.Names("compose"))
    try:
        yield c
    finally:
        owners = set()
        try:
            owners = _executor_owners(c)
        finally:
            client.close()
            c.compose("down", "-v", "--timeout", "30", timeout=300)
        _assert_nothing_left(project, owners)


def _assert_nothing_left(project: str, owners: set[str]) -> None:
    label = f"label=com.docker.compose.project={project}"
    assert _docker("ps", "-a", "-q", "--filter", label).split() == []
    assert _docker("volume", "ls", "-q", "--filter", label).split() == []
    assert _docker("network", "ls", "-q", "--filter", label).split() == []
    deadline = time.monotonic() + 20  # AutoRemove of the sandboxes of killed executors
    while True:
        out = _docker("ps", "-a", "--filter", "label=streamrl.sandbox", "--format",
                      '{{.Names}} {{.Label "streamrl.owner"}}')  # fmt: skip
        ours = [line for line in out.splitlines()
                if line.split(" ", 1)[-1].split("/", 1)[0] in owners]  # fmt: skip
        if not ours or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert ours == [], f"sandbox containers of the project's executors left: {ours}"


def test_cluster_trains_scales_and_survives_killed_replicas(cluster: Cluster) -> None:
    started = time.monotonic()
    # Given the cluster with two generators and two verifiers
    cluster.compose("up", "-d", "--scale", "generator=2", "--scale", "verifier=2", timeout=300)
    cluster.figures["up_s"] = round(time.monotonic() - started, 1)
    _wait("two learner steps", cluster, lambda: cluster.version() >= 2, 240)
    cluster.figures["first_steps_s"] = round(time.monotonic() - started, 1)

    # When the executor is scaled from 1 to 3 while training runs
    before = set(cluster.consumers(N.ROLLOUTS))
    old = set(cluster.containers("executor").values())
    t_scale = time.time()
    cluster.compose("up", "-d", "--no-recreate", "--scale", "executor=3", "--scale",
                    "generator=2", "--scale", "verifier=2")  # fmt: skip
    cluster.figures["scale_command_s"] = round(time.time() - t_scale, 1)
    new = set(cluster.containers("executor").values()) - old
    assert len(new) == 2
    joined = _wait("the new executors to join the executor group", cluster,
                   lambda: len(set(cluster.consumers(N.ROLLOUTS)) - before) >= 2 or None, 120,
                   poll_s=0.2)  # fmt: skip
    cluster.figures["scale_to_joined_s"] = round(time.time() - t_scale, 1)
    assert joined
    first = _wait("a new executor to handle a message", cluster,
                  lambda: min((t for c in new if (t := _first_event(c, "executed"))),
                              default=None), 120)  # fmt: skip
    cluster.figures["scale_to_first_handled_s"] = round(first - t_scale, 1)
    ready = min(t for c in new if (t := _first_event(c, "actor ready")))
    cluster.figures["scale_to_actor_ready_s"] = round(ready - t_scale, 1)

    # and a generator and a verifier are killed
    steps_at_kill = cluster.version()
    victims = [cluster.containers("generator")[1], cluster.containers("verifier")[1]]
    _docker("kill", *victims)

    # Then training continues
    _wait("two more learner steps", cluster, lambda: cluster.version() >= steps_at_kill + 2, 180)

    # and every admitted group is accounted for, nothing pending
    limit = 40  # scheduler.max_train_groups in configs/compose-host.toml

    def settled() -> dict[str, int] | None:
        ledger = cluster.ledger()
        groups = cluster.groups()
        idle = all(groups.get(s, (0, 0)) == (0, 0) for s in PIPELINE)
        done = ledger["trained"] + ledger["dropped_stale"] + ledger["dead_letters"]
        return ledger if ledger["admitted"] == limit and done >= limit and idle else None

    ledger = _wait("every admitted group trained or dead-lettered", cluster, settled, 240)
    assert ledger["trained"] + ledger["dropped_stale"] + ledger["dead_letters"] == limit, ledger
    assert all(pending == 0 for _, pending in cluster.groups().values()), cluster.groups()
    assert ledger["trained"] > 0
    cluster.figures.update(ledger, steps=cluster.version(), steps_at_kill=steps_at_kill)
    cluster.figures["wall_s_before_down"] = round(time.monotonic() - started, 1)
    (ROOT / "runs").mkdir(exist_ok=True)
    (ROOT / "runs" / "compose-test.json").write_text(json.dumps(cluster.figures, indent=2))
    print("compose test figures:", json.dumps(cluster.figures))
