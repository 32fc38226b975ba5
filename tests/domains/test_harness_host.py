"""The host's side of the sandbox harnesses (domains/kinds/harness_host.py): what is staged
beside a harness, and which output counts as its report. The harnesses themselves are run
for real by tests/domains/test_kinds_*.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from streamrl.domains.kinds.harness_host import (
    COMMON,
    decode_report,
    harness_files,
    report_body,
    report_nonce,
)
from streamrl.sandbox.base import ExecResult

NONCE = report_nonce("item-1", "print(1)", b"hidden tests")


def _result(stdout: bytes, exit_code: int | None = 0, timed_out: bool = False,
            dropped: int = 0) -> ExecResult:
    return ExecResult(exit_code=exit_code, stdout=stdout, stderr=b"", timed_out=timed_out,
                      oom_killed=False, duration_s=0.1, stdout_dropped=dropped)


def test_the_common_module_is_staged_beside_the_harness_hidden_beside_a_hidden_one() -> None:
    assert set(harness_files("stdio_harness.py")) == {"stdio_harness.py", COMMON}
    assert set(harness_files("harbor_harness.py", ".harbor_harness.py")) == {
        ".harbor_harness.py", "." + COMMON}


def test_only_the_one_line_under_the_nonce_with_exit_0_is_a_report() -> None:
    line = NONCE.encode() + b' {"reward": 1}\n'
    assert report_body(_result(line), NONCE) == '{"reward": 1}'
    assert decode_report(_result(line), NONCE, dict) == {"reward": 1}
    assert report_body(_result(b"PASS\n" + line), NONCE) is None  # a second line
    assert report_body(_result(b"x" * 64 + b' {"reward": 1}\n'), NONCE) is None  # nonce
    assert report_body(_result(line, exit_code=1), NONCE) is None
    assert report_body(_result(line, exit_code=None, timed_out=True), NONCE) is None
    assert report_body(_result(line, dropped=10), NONCE) is None
    assert report_body(None, NONCE) is None
    assert decode_report(_result(NONCE.encode() + b" [1]\n"), NONCE, dict) is None


def test_a_staged_harness_runs_with_the_common_module_as_staged(tmp_path: Path) -> None:
    # Given the harbor harness staged as the kind stages it, hidden, in an empty dir
    for name, data in harness_files("harbor_harness.py", ".harbor_harness.py").items():
        (tmp_path / name).write_bytes(data)
    spec = (b'{"nonce": "n0", "script": "echo hi", "tests": {}, "workdir": "/app",'
            b' "solution_timeout_s": 5, "test_timeout_s": 5}')
    # When it runs there under python3 -I
    out = subprocess.run([sys.executable, "-I", ".harbor_harness.py"], input=spec,
                         cwd=tmp_path, capture_output=True, timeout=30, check=True)
    # Then it loaded the common module (no .pyc written) and printed one report line
    assert out.stdout.startswith(b"n0 {") and out.stdout.count(b"\n") == 1
    assert not (tmp_path / "__pycache__").exists()
