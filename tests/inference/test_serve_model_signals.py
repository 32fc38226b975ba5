"""Ctrl-C on a real ``streamrl serve-model`` process (issue 32, item 7): it shuts down cleanly,
no traceback, exit 0 (as ``streamrl up`` stops it, with SIGINT)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from streamrl.testing.serve_model import start_serve_model, wait_healthy


def test_ctrl_c_stops_serve_model_cleanly(tmp_path: Path) -> None:
    # Given a serving serve-model
    server = start_serve_model(tmp_path)
    try:
        wait_healthy(server)
        # When it gets SIGINT (Ctrl-C)
        server.process.send_signal(signal.SIGINT)
        code = server.process.wait(60)
    finally:
        server.kill()
    # Then it exits 0 and says so, without a traceback
    log = server.log.read_text()
    assert "Traceback" not in log, log[-3000:]
    assert code == 0, log[-3000:]
    assert '"event": "stopped"' in log, log[-3000:]


def test_a_mistyped_model_is_one_line_naming_the_valid_specs() -> None:
    # When serve-model is given a model spec that does not exist
    done = subprocess.run([sys.executable, "-m", "streamrl", "serve-model", "--model", "smolm2"],
                          capture_output=True, text=True, timeout=120)
    # Then it exits non-zero with one line that names the valid specs, no traceback
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "unknown model spec 'smolm2'" in lines[0] and "'tiny'" in lines[0], lines
