"""A Docker API proxy that lets an executor do what :mod:`sandbox.docker` does, and no more.

Whoever can talk to a Docker engine is root on its host (a privileged container, a bind of
``/``). The executor needs the engine only for its sandbox containers, so it is given this
proxy instead of the socket (``DOCKER_HOST=unix:///run/streamrl-docker/docker.sock``):

    python -m streamrl.sandbox.socket_proxy --listen unix:/run/streamrl-docker/docker.sock \
        [--upstream /var/run/docker.sock] [--image streamrl-sandbox]

Guarantees: every request is checked before one byte of it reaches the engine, and is
forwarded only if it is one of these (an optional ``/vX.Y`` prefix is allowed):

- ``GET|HEAD /_ping``, ``GET /version``, ``GET /images/{name}/json``;
- ``GET /containers/json`` filtered by the label ``streamrl.sandbox``;
- ``POST /containers/create`` whose body has the hardening of :mod:`sandbox.docker`: only
  known fields; ``NetworkMode`` none and ``NetworkDisabled``; never privileged; ``CapDrop``
  ALL and no ``CapAdd``; ``no-new-privileges`` and no unconfined seccomp / AppArmor / label;
  read-only root; no binds, mounts, volumes, devices, ports, sysctls, cgroup parent; no
  ``host`` or ``container:`` pid / ipc / uts / userns / cgroup namespace; a memory and a pids
  limit; a non-root ``User``; the ``streamrl.sandbox`` label; a ``streamrl-`` name; with
  ``--image``, an image that starts with one of the given prefixes;
- on a container that carries the ``streamrl.sandbox`` label (asked of the engine first):
  ``start``, ``attach`` (the hijacked stream is then piped both ways), ``kill``, ``wait``,
  ``json`` (inspect), ``DELETE``, ``rename`` to a ``streamrl-`` name, ``update`` of the
  memory, swap and pids limits only.

Everything else (exec, build, pull, volumes, networks, other containers, the engine's info,
events, logs, archive up- and downloads) is answered ``403`` with a JSON ``message``. Exec is
refused although it is a container call: the Docker backend never uses it (its runner is the
container's command), and an exec may ask for root and privileges of its own.

Not covered: the proxy trusts the engine's answer about a container's labels, and a client
may create up to the engine's limits (as many containers as it likes, any image unless
``--image`` is given). Each request gets its own upstream connection, closed after the
response (``Connection: close``), so a pipelined second request is never forwarded unchecked.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import structlog
import trio

log = structlog.get_logger()

LABEL = "streamrl.sandbox"
MAX_HEAD = 64 * 1024
MAX_BODY = 1 << 20
_VERSION = re.compile(r"^/v\d+(\.\d+)?(?=/)")
_NAME = re.compile(r"^/?streamrl-[A-Za-z0-9_.-]+$")
_CONTAINER_OP = re.compile(r"^/containers/([A-Za-z0-9_.-]+)(?:/([a-z]+))?$")
_CONTAINER_OPS = {
    ("POST", "start"),
    ("POST", "attach"),
    ("POST", "kill"),
    ("POST", "wait"),
    ("GET", "json"),
    ("DELETE", None),
    ("POST", "rename"),
    ("POST", "update"),
}

CREATE_FIELDS = frozenset({
    "Image", "Entrypoint", "Cmd", "User", "WorkingDir", "Env", "Hostname", "NetworkDisabled",
    "AttachStdin", "AttachStdout", "AttachStderr", "OpenStdin", "StdinOnce", "Tty", "Labels",
    "HostConfig", "StopTimeout", "StopSignal",
})  # fmt: skip
HOST_FIELDS = frozenset({
    "NetworkMode", "CapDrop", "SecurityOpt", "Privileged", "ReadonlyRootfs", "Tmpfs",
    "IpcMode", "ShmSize", "Memory", "MemorySwap", "NanoCpus", "PidsLimit", "Ulimits", "Init",
    "OomScoreAdj", "AutoRemove", "LogConfig", "Runtime",
})  # fmt: skip
UPDATE_FIELDS = frozenset({"Memory", "MemorySwap", "PidsLimit", "NanoCpus"})
RUNTIMES = frozenset({"runc", "runsc"})
_UNCONFINED = ("seccomp=unconfined", "seccomp:unconfined", "apparmor=unconfined",
               "apparmor:unconfined", "label=disable", "label:disable",
               "systempaths=unconfined")  # fmt: skip


class Refused(Exception):
    """The request is not one the executor may make (answered 403, never forwarded)."""


@dataclass
class Request:
    method: str
    target: str
    version: str
    headers: list[tuple[str, str]]
    body: bytes = b""
    path: str = ""
    query: dict[str, list[str]] = field(default_factory=dict)

    def header(self, name: str) -> str:
        for k, v in self.headers:
            if k.lower() == name:
                return v
        return ""

    @property
    def upgrade(self) -> bool:
        return "upgrade" in self.header("connection").lower()


@dataclass
class Policy:
    """What the proxy lets through (see the module docstring)."""

    images: tuple[str, ...] = ()
    """Image name prefixes a sandbox may be created from (empty: any)."""

    def check(self, req: Request) -> str | None:
        """Raise :class:`Refused`, or return the id of a container whose ``streamrl.sandbox``
        label must be confirmed with the engine before forwarding (None: nothing to confirm)."""
        method, path = req.method, req.path
        if (method, path) in {("GET", "/_ping"), ("HEAD", "/_ping"), ("GET", "/version")}:
            return None
        if method == "GET" and re.fullmatch(r"/images/.+/json", path):
            return None
        if (method, path) == ("GET", "/containers/json"):
            self._check_list(req)
            return None
        if (method, path) == ("POST", "/containers/create"):
            self._check_create(req)
            return None
        m = _CONTAINER_OP.match(path)
        if m and m.group(1) not in (".", "..") and (method, m.group(2)) in _CONTAINER_OPS:
            if m.group(2) == "rename" and not _NAME.match(req.query.get("name", [""])[0]):
                raise Refused("rename: the new name must start with streamrl-")
            if m.group(2) == "update":
                self._check_update(req)
            return m.group(1)
        raise Refused(f"{method} {path} is not a call the sandbox backend makes")

    def _check_list(self, req: Request) -> None:
        try:
            filters = json.loads(req.query.get("filters", ["{}"])[0])
            labels = filters.get("label", [])
            if isinstance(labels, dict):  # the older {"label": {"x": true}} form
                labels = [k for k, v in labels.items() if v]
        except (ValueError, AttributeError):
            raise Refused("list: malformed filters") from None
        if not any(str(x).split("=", 1)[0] == LABEL for x in labels):
            raise Refused(f"list: only containers filtered by the label {LABEL}")

    def _check_create(self, req: Request) -> None:
        name = req.query.get("name", [""])[0]
        if not _NAME.match(name):
            raise Refused("create: the container name must start with streamrl-")
        body = _json_body(req)
        _only(body, CREATE_FIELDS, "")
        host = body.get("HostConfig") or {}
        if not isinstance(host, dict):
            raise Refused("create: HostConfig must be an object")
        _only(host, HOST_FIELDS, "HostConfig.")
        if host.get("Privileged"):
            raise Refused("create: privileged containers are refused")
        if host.get("NetworkMode") != "none" or body.get("NetworkDisabled") is not True:
            raise Refused("create: NetworkMode must be none (and NetworkDisabled true)")
        if "ALL" not in (host.get("CapDrop") or []):
            raise Refused("create: CapDrop must be ALL")
        options = [str(o) for o in host.get("SecurityOpt") or []]
        if not any(o.replace("=", ":") in ("no-new-privileges", "no-new-privileges:true")
                   for o in options):  # fmt: skip
            raise Refused("create: SecurityOpt must hold no-new-privileges")
        if any(o.startswith(_UNCONFINED) for o in options):
            raise Refused("create: unconfined seccomp / AppArmor / labels are refused")
        if host.get("ReadonlyRootfs") is not True:
            raise Refused("create: the root file system must be read-only")
        if str(host.get("IpcMode") or "private") not in ("private", "none"):
            raise Refused("create: IpcMode must be private or none")
        if not _positive(host.get("Memory")) or not _positive(host.get("PidsLimit")):
            raise Refused("create: a memory and a pids limit are required")
        if host.get("Runtime") and host["Runtime"] not in RUNTIMES:
            raise Refused(f"create: runtime {host['Runtime']!r} is not one of {sorted(RUNTIMES)}")
        user = str(body.get("User") or "")
        if user.split(":", 1)[0] in ("", "0", "root"):
            raise Refused("create: the container must run as a non-root User")
        if LABEL not in (body.get("Labels") or {}):
            raise Refused(f"create: the container must carry the label {LABEL}")
        image = str(body.get("Image") or "")
        if self.images and not image.startswith(self.images):
            raise Refused(f"create: image {image!r} is not allowed")

    def _check_update(self, req: Request) -> None:
        body = _json_body(req)
        _only(body, UPDATE_FIELDS, "update: ")
        for key in ("Memory", "MemorySwap", "PidsLimit"):
            if key in body and not _positive(body[key]):
                raise Refused(f"update: {key} must stay a positive limit")


def _json_body(req: Request) -> dict[str, Any]:
    try:
        body = json.loads(req.body or b"{}")
    except ValueError:
        raise Refused("malformed JSON body") from None
    if not isinstance(body, dict):
        raise Refused("the JSON body must be an object")
    return body


def _only(obj: dict[str, Any], allowed: frozenset[str], where: str) -> None:
    for key, value in obj.items():
        if key not in allowed and value not in (None, "", [], {}, False, 0):
            raise Refused(f"create: {where}{key} is not allowed" if where != "update: "
                          else f"update: {key} is not allowed")  # fmt: skip


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


# -- HTTP ----------------------------------------------------------------------------------


class _Reader:
    """Buffered reads off a trio stream."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self.stream = stream
        self.buf = bytearray()

    async def fill(self) -> bool:
        data = await self.stream.receive_some(65536)
        self.buf += data
        return bool(data)

    async def until(self, marker: bytes, limit: int) -> bytes:
        while (i := self.buf.find(marker)) < 0:
            if len(self.buf) > limit or not await self.fill():
                raise Refused("request head too long or cut short")
        out = bytes(self.buf[: i + len(marker)])
        del self.buf[: i + len(marker)]
        return out

    async def exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not await self.fill():
                raise Refused("request body cut short")
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out


async def read_request(reader: _Reader) -> Request:
    head = (await reader.until(b"\r\n\r\n", MAX_HEAD)).decode("latin-1")
    line, *lines = head[:-4].split("\r\n")
    try:
        method, target, version = line.split(" ")
    except ValueError:
        raise Refused("malformed request line") from None
    headers = []
    for h in lines:
        k, sep, v = h.partition(":")
        if not sep:
            raise Refused("malformed header")
        headers.append((k.strip(), v.strip()))
    req = Request(method.upper(), target, version, headers)
    if req.header("transfer-encoding").lower() == "chunked":
        chunks = []
        while True:
            size = int((await reader.until(b"\r\n", 64)).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                await reader.until(b"\r\n", MAX_HEAD)  # trailers end with an empty line
                break
            chunks.append(await reader.exactly(size))
            await reader.exactly(2)
            if sum(map(len, chunks)) > MAX_BODY:
                raise Refused("request body too large")
        req.body = b"".join(chunks)
    elif req.header("content-length"):
        length = int(req.header("content-length"))
        if length > MAX_BODY:
            raise Refused("request body too large")
        req.body = await reader.exactly(length)
    url = urlsplit(target)
    req.path = _VERSION.sub("", unquote(url.path))
    req.query = parse_qs(url.query)
    return req


def _encode(req: Request) -> bytes:
    drop = {"connection", "keep-alive", "transfer-encoding", "content-length", "upgrade"}
    lines = [f"{req.method} {req.target} HTTP/1.1"]
    lines += [f"{k}: {v}" for k, v in req.headers if k.lower() not in drop]
    if req.upgrade:
        lines += ["Connection: Upgrade", f"Upgrade: {req.header('upgrade') or 'tcp'}"]
    else:
        lines.append("Connection: close")
    if req.body or req.method in ("POST", "PUT"):
        lines.append(f"Content-Length: {len(req.body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + req.body


def _refusal(reason: str) -> bytes:
    body = json.dumps({"message": f"streamrl docker proxy: {reason}"}).encode()
    return (
        b"HTTP/1.1 403 Forbidden\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )


@dataclass
class Proxy:
    upstream: str = "/var/run/docker.sock"
    policy: Policy = field(default_factory=Policy)
    counts: dict[str, int] = field(default_factory=lambda: {"allowed": 0, "refused": 0})

    async def _labelled(self, container: str) -> bool:
        """Whether the engine says ``container`` carries the sandbox label."""
        stream = await trio.open_unix_socket(self.upstream)
        async with stream:
            await stream.send_all(
                f"GET /containers/{container}/json HTTP/1.1\r\nHost: docker\r\n"
                "Connection: close\r\n\r\n".encode()
            )
            data = bytearray()
            while chunk := await stream.receive_some(65536):
                data += chunk
        head, _, body = bytes(data).partition(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            return False
        if b"transfer-encoding: chunked" in head.lower():
            body = _dechunk(body)
        try:
            labels = json.loads(body).get("Config", {}).get("Labels") or {}
        except ValueError:
            return False
        return LABEL in labels

    async def handle(self, client: trio.abc.Stream) -> None:
        async with client:
            reader = _Reader(client)
            try:
                req = await read_request(reader)
                container = self.policy.check(req)
                if container is not None and not await self._labelled(container):
                    raise Refused(f"container {container} is not a streamrl sandbox")
            except Refused as exc:
                self.counts["refused"] += 1
                log.warning("docker_proxy.refused", reason=str(exc))
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await client.send_all(_refusal(str(exc)))
                return
            except (ValueError, trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                return
            self.counts["allowed"] += 1
            log.debug("docker_proxy.forward", method=req.method, path=req.path)
            await self._forward(req, reader, client)

    async def _forward(self, req: Request, reader: _Reader, client: trio.abc.Stream) -> None:
        try:
            upstream = await trio.open_unix_socket(self.upstream)
        except OSError as exc:
            log.error("docker_proxy.upstream_unreachable", error=str(exc))
            return
        async with upstream, trio.open_nursery() as nursery:

            async def down() -> None:
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    while data := await upstream.receive_some(65536):
                        await client.send_all(data)
                nursery.cancel_scope.cancel()

            async def up() -> None:  # the hijacked attach stream only: stdin of the sandbox
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    if reader.buf:
                        await upstream.send_all(bytes(reader.buf))
                        reader.buf.clear()
                    while data := await client.receive_some(65536):
                        await upstream.send_all(data)
                    await upstream.send_eof()

            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await upstream.send_all(_encode(req))
            nursery.start_soon(down)
            if req.upgrade:
                nursery.start_soon(up)


def _dechunk(body: bytes) -> bytes:
    out, rest = bytearray(), body
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out += rest[:size]
        rest = rest[size + 2 :]
    return bytes(out)


async def serve_proxy(
    listen: str,
    proxy: Proxy,
    *,
    task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``proxy`` on ``unix:PATH`` (mode 0660 unless $STREAMRL_PROXY_MODE) or
    ``tcp:127.0.0.1:PORT``; never returns."""
    listeners: Sequence[trio.SocketListener]
    if listen.startswith("unix:"):
        path = listen[len("unix:") :]
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
        await sock.bind(path)
        os.chmod(path, int(os.environ.get("STREAMRL_PROXY_MODE", "660"), 8))
        sock.listen(128)
        listeners = [trio.SocketListener(sock)]
    elif listen.startswith("tcp:"):
        host, _, port = listen[len("tcp:") :].rpartition(":")
        listeners = await trio.open_tcp_listeners(int(port), host=host or "127.0.0.1")
    else:
        raise ValueError(f"--listen {listen!r}: use unix:PATH or tcp:HOST:PORT")
    log.info("docker_proxy.serving", listen=listen, upstream=proxy.upstream,
             images=list(proxy.policy.images))  # fmt: skip
    await trio.serve_listeners(proxy.handle, list(listeners), task_status=task_status)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m streamrl.sandbox.socket_proxy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--listen", default="unix:/run/streamrl-docker/docker.sock")
    p.add_argument("--upstream", default="/var/run/docker.sock", help="the engine's socket")
    p.add_argument("--image", action="append", default=[], help="allowed image prefix")
    args = p.parse_args(argv)
    structlog.configure(
        processors=[structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso", utc=True),
                    structlog.processors.JSONRenderer()],
        wrapper_class=structlog.make_filtering_bound_logger(20),  # info: refusals, not calls
    )  # fmt: skip
    proxy = Proxy(args.upstream, Policy(tuple(args.image)))
    with contextlib.suppress(KeyboardInterrupt):
        trio.run(serve_proxy, args.listen, proxy)
    return 0


if __name__ == "__main__":
    sys.exit(main())
