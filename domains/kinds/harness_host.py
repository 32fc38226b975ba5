"""The host's side of every verifier harness: what is staged, the nonce, the report.

A kind that judges in the sandbox stages its harness with :func:`harness_files` (the harness
and :mod:`~streamrl.domains.kinds.harness_common` beside it), runs it with
:func:`harness_request` (``python3 -I <harness>``, the spec as JSON on stdin) and trusts only
:func:`report_body`: the one line ``<nonce> <json>`` the harness prints, with exit code 0, no
timeout, nothing dropped, and the nonce it expects. The nonce (:func:`report_nonce`) is an
HMAC of the item id and the completion under ``$STREAMRL_VERIFY_KEY`` (one per deployment),
or else under a digest of the item's hidden material; executor and verifier compute it
alike, the model's code never sees it.

:func:`harness_failure` tells a harness that failed by itself (a Python traceback, or it
could not start) from a run that left no report for what the model's code did (the harness
killed or stopped by it, the deadline, out of memory: those score 0). The model's code runs
in the harness's children, on pipes of their own, so it cannot write the harness's stderr.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from streamrl.domains.base import VerifierFailed
from streamrl.sandbox.base import ExecRequest, ExecResult, Limits

KEY_ENV = "STREAMRL_VERIFY_KEY"
COMMON = "harness_common.py"
_HERE = Path(__file__).parent
T = TypeVar("T")


def harness_files(source: str, staged_as: str | None = None) -> dict[str, bytes]:
    """The harness ``source`` (a file of this package) staged as ``staged_as`` (default its
    own name), with the common module beside it (hidden when the harness is)."""
    name = staged_as or source
    common = ("." if name.startswith(".") else "") + COMMON
    return {name: _source(source), common: _source(COMMON)}


@cache
def _source(name: str) -> bytes:
    return (_HERE / name).read_bytes()


def harness_request(harness: str, spec: Mapping[str, Any], limits: Limits,
                    files: Mapping[str, bytes]) -> ExecRequest:
    """Run ``python3 -I <harness>`` on ``spec`` (its stdin) with ``files`` staged first."""
    return ExecRequest(argv=["python3", "-I", harness], files=dict(files),
                       stdin=json.dumps(spec).encode(), limits=limits)


def report_nonce(item_id: str, completion: str, hidden: bytes) -> str:
    """HMAC of the item id and the completion under ``$STREAMRL_VERIFY_KEY``, else under the
    digest of ``hidden`` (what the item keeps from the model)."""
    key = os.environ.get(KEY_ENV, "").encode() or hashlib.sha256(hidden).digest()
    msg = item_id.encode() + b"\0" + completion.encode("utf-8", "replace")
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def report_body(result: ExecResult | None, nonce: str) -> str | None:
    """The JSON after the nonce if the run printed exactly the harness's one line under
    ``nonce``, with exit code 0, no timeout and no output dropped; else None."""
    if result is None or result.timed_out or result.exit_code != 0:
        return None
    lines = result.stdout.decode("utf-8", "replace").strip().splitlines()
    if len(lines) != 1 or result.stdout_dropped:
        return None
    head, _, body = lines[0].partition(" ")
    return body if hmac.compare_digest(head, nonce) else None


def decode_report(result: ExecResult | None, nonce: str, as_type: type[T]) -> T | None:
    """:func:`report_body` decoded as ``as_type``; None when it is missing or not one."""
    body = report_body(result, nonce)
    if body is None:
        return None
    try:
        return msgspec.json.decode(body, type=as_type)
    except msgspec.DecodeError:
        return None


_TRACEBACK = "Traceback (most recent call last):"


def harness_failure(result: ExecResult | None) -> str | None:
    """Why the harness failed by itself (it raised: exit 1 and a traceback on its stderr; or
    it could not be started: exit 126 or 127), else None."""
    if result is None or result.timed_out or result.oom_killed:
        return None
    stderr = result.stderr.decode("utf-8", "replace")
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    if result.exit_code == 1 and _TRACEBACK in stderr and lines:
        return f"the harness crashed: {lines[-1][:300]}"
    if result.exit_code in (126, 127):
        return f"the harness could not start (exit {result.exit_code}): " + (
            lines[-1][:300] if lines else "no output")
    return None


def check_harness(result: ExecResult | None) -> None:
    """:class:`~streamrl.domains.base.VerifierFailed` if the harness failed by itself
    (:func:`harness_failure`): what a kind's ``score`` calls when it found no report."""
    why = harness_failure(result)
    if why is not None:
        raise VerifierFailed(why)
