"""Ctrl-C on a real ``streamrl serve-model`` process (issue 32, item 7): it shuts down cleanly,
no traceback, exit 0 (as ``streamrl up`` stops it, with SIGINT)."""

from __future__ import annotations

import signal
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
