"""The host side of the conversation with a resident runner (:mod:`sandbox.runner`).

Both backends keep one runner per sandbox (a Docker container's attached stdin/stdout, or two
pipes to a resident bubblewrap sandbox) and speak the same protocol to it: a frame is a 4-byte
big-endian header length, a JSON header, then ``header["n"]`` payload bytes; ops ``run``,
``put``, ``get``, ``reset``. A :class:`RunnerChannel` is that conversation; the backend hands
it a :class:`RunnerTransport` (how bytes travel) and a ``discard`` coroutine (what to do with a
runner that cannot be trusted any more: kill the sandbox, remove the container).

Guarantees:
- one request at a time; a reply counts only if it echoes the request's random nonce;
- a runner that sent anything else, sent nothing by the host deadline, exited, or was
  interrupted mid-request (cancellation) is marked ``gone`` and never spoken to again:
  :meth:`RunnerChannel.call` raises :class:`RunnerGone` (``stuck`` when it did not answer in
  time);
- :meth:`RunnerChannel.control` (put/get/reset) discards a lost runner and raises
  ``SandboxUnavailable``; :meth:`RunnerChannel.run` returns what the code did as an
  :class:`ExecResult` and leaves a lost runner to the backend (which knows how to report it);
- an error the runner answers (``{"error": ...}``) raises ``SandboxUnavailable``; a file the
  code's doing kept from being written (``{"refused": ...}``) raises ``WriteRefused``; a
  request that cannot be expressed (a NUL or a lone surrogate in an argument or a path)
  raises ``ValueError`` before it is sent.
"""

from __future__ import annotations

import json
import secrets
import struct
import time
from collections.abc import Awaitable, Callable
from pathlib import PurePosixPath
from typing import Any, Protocol

import trio

from streamrl.sandbox.base import (
    ExecRequest,
    ExecResult,
    Limits,
    SandboxUnavailable,
    WriteRefused,
    check_request,
    check_text,
)

MAX_HEADER = 1 << 20
CONTROL_TIMEOUT_S = 10.0


class RunnerGone(Exception):
    """The runner cannot be trusted any more (no reply, EOF, forged reply): discard it.

    ``stuck``: it did not answer in time; ``ended``: it exited or its connection broke (not
    a reply the code could have forged)."""

    def __init__(self, reason: str, *, stuck: bool = False, ended: bool = False) -> None:
        super().__init__(reason)
        self.stuck = stuck
        self.ended = ended


class RunnerTransport(Protocol):
    """How bytes reach one runner and come back (the backend's side of the channel)."""

    async def send(self, data: bytes) -> None:
        """Write ``data`` to the runner's stdin."""
        ...

    async def receive(self) -> bytes:
        """The next bytes of the runner's stdout, ``b""`` once it ended; raises
        :class:`RunnerGone` when the connection failed."""
        ...

    def diagnostics(self) -> str:
        """What the runner wrote to stderr lately (for "the runner exited"), or ``""``."""
        ...


class RunnerChannel:
    """The framed request/reply conversation with one runner (see the module docstring)."""

    def __init__(self, transport: RunnerTransport, discard: Callable[[], Awaitable[None]]) -> None:
        self.gone: str | None = None
        self._transport = transport
        self._discard = discard
        self._buf = bytearray()

    async def wait_ready(self, timeout_s: float) -> dict:
        """The runner's first frame (its hello), or :class:`RunnerGone`."""
        with trio.move_on_after(timeout_s):
            hello, _ = await self.read_frame()
            if hello.get("op") != "ready":
                raise RunnerGone(f"unexpected first frame {hello!r}")
            return hello
        raise RunnerGone(f"the runner was not ready after {timeout_s} s", stuck=True)

    async def run(
        self,
        request: ExecRequest,
        limits: Limits,
        timeout_s: float,
        extra: dict[str, Any] | None = None,
    ) -> ExecResult:
        """Run ``request`` (files, argv, stdin) under ``limits`` (``extra``: more header fields,
        e.g. rlimits only the process backend sets). What the code did is data; a lost runner
        raises :class:`RunnerGone` (see :func:`lost_result`)."""
        check_request(request.argv)
        files = [(str(checked_path(name)), data) for name, data in request.files.items()]
        header = {
            "op": "run",
            "argv": list(request.argv),
            "files": [[name, len(data)] for name, data in files],
            "timeout": limits.timeout_s,
            "cpu_s": limits.cpu_s,
            "fsize_mb": limits.max_file_mb,
            "nofile": limits.max_open_files,
            **(extra or {}),
            "cap": limits.output_bytes,
        }
        payload = b"".join(data for _, data in files) + request.stdin
        reply, out = await self.call(header, payload, timeout_s)
        _raise_error(reply)
        out_n = reply["out_n"]
        return ExecResult(
            exit_code=reply["exit_code"],
            stdout=out[:out_n],
            stderr=out[out_n:],
            timed_out=reply["timed_out"],
            oom_killed=reply["oom"],
            duration_s=reply["duration_s"],
            stdout_dropped=reply["out_dropped"],
            stderr_dropped=reply["err_dropped"],
        )

    async def put_files(self, files: dict[str, bytes]) -> None:
        checked = [(str(checked_path(name)), data) for name, data in files.items()]
        header = {"op": "put", "files": [[name, len(data)] for name, data in checked]}
        await self.control(header, b"".join(data for _, data in checked))

    async def get_files(self, paths: list[str], cap: int) -> dict[str, bytes | None]:
        names = [str(checked_path(p)) for p in paths]
        reply, payload = await self.control({"op": "get", "paths": names, "cap": cap})
        out: dict[str, bytes | None] = {}
        offset = 0
        for path, size in zip(paths, reply["sizes"], strict=True):
            out[path] = None if size < 0 else payload[offset : offset + size]
            offset += max(size, 0)
        return out

    async def reset(self) -> None:
        await self.control({"op": "reset"})

    async def control(self, header: dict[str, Any], payload: bytes = b"") -> tuple[dict, bytes]:
        """A put/get/reset call: any runner failure discards it (``SandboxUnavailable``)."""
        try:
            reply, out = await self.call(header, payload, CONTROL_TIMEOUT_S)
        except RunnerGone as exc:
            await self._discard()
            raise SandboxUnavailable(f"sandbox runner lost: {exc}") from exc
        _raise_error(reply)
        return reply, out

    async def call(
        self, header: dict[str, Any], payload: bytes, timeout_s: float
    ) -> tuple[dict, bytes]:
        """Send one request, wait for its reply; the reply must echo the request's nonce."""
        if self.gone is not None:
            raise RunnerGone(self.gone)
        nonce = secrets.token_hex(16)
        raw = json.dumps({**header, "id": nonce, "n": len(payload)}).encode()
        try:
            with trio.move_on_after(timeout_s) as deadline:
                await self._transport.send(struct.pack(">I", len(raw)) + raw + payload)
                reply, out = await self.read_frame()
        except RunnerGone as exc:
            self.gone = str(exc)
            raise
        except BaseException:  # cancelled or broken mid-conversation: never reuse this runner
            self.gone = "interrupted mid-request"
            raise
        if deadline.cancelled_caught:
            self.gone = "no reply from the runner by the host deadline"
            raise RunnerGone(self.gone, stuck=True)
        if reply.get("id") != nonce:
            self.gone = "the runner's reply was forged or out of order"
            raise RunnerGone(self.gone)
        return reply, out

    async def read_frame(self) -> tuple[dict, bytes]:
        buf = self._buf
        while True:
            if len(buf) >= 4:
                (size,) = struct.unpack(">I", buf[:4])
                if size > MAX_HEADER:
                    raise RunnerGone("malformed frame from the runner")
                if len(buf) >= 4 + size:
                    try:
                        header = json.loads(buf[4 : 4 + size])
                        end = 4 + size + int(header["n"])
                    except (ValueError, KeyError, TypeError) as exc:
                        raise RunnerGone(f"malformed frame from the runner: {exc}") from exc
                    if len(buf) >= end:
                        with memoryview(buf) as view:  # (one copy of a large payload)
                            payload = bytes(view[4 + size : end])
                        del buf[:end]
                        return header, payload
            chunk = await self._transport.receive()
            if not chunk:
                diag = self._transport.diagnostics()
                raise RunnerGone("the runner exited" + (f": {diag}" if diag else ""), ended=True)
            buf += chunk


def lost_result(exc: RunnerGone, what_happened: str, oom_killed: bool, start: float) -> ExecResult:
    """The result of a run whose runner was lost (``start``: ``time.monotonic()`` before it)."""
    return ExecResult(
        exit_code=None,
        stdout=b"",
        stderr=f"sandbox: {exc}; {what_happened}\n".encode(),
        timed_out=exc.stuck,
        oom_killed=oom_killed,
        duration_s=time.monotonic() - start,
    )


def checked_path(name: str) -> PurePosixPath:
    """``name`` as a relative path without ``..``, or ``ValueError`` (a request that cannot
    be expressed: also a NUL or a character UTF-8 cannot encode)."""
    rel = PurePosixPath(name)
    if not name or rel.is_absolute() or ".." in rel.parts or rel == PurePosixPath("."):
        raise ValueError(f"sandbox file {name!r} must be a relative path without '..'")
    check_text(f"sandbox file {name[:80]!r}", name)
    return rel


def _raise_error(reply: dict) -> None:
    if "refused" in reply:
        raise WriteRefused(str(reply["refused"]))
    if "error" in reply:
        raise SandboxUnavailable(f"sandbox runner: {reply['error']}")
