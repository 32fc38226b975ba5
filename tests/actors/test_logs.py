"""runtime/logs.py: every line an actor logs is one JSON object, stdlib ``logging`` included."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys

from streamrl.runtime.logs import configure_logging, get_logger


def test_stdlib_records_come_out_as_json_lines() -> None:
    # Given transformers loaded (it sets up a stderr handler of its own, propagation off, as
    # when a model was loaded before) and the logging of an actor process
    from transformers.utils import logging as hf_logging

    hf_logging.enable_default_handler()
    hf_logging.disable_propagation()
    out = io.StringIO()
    configure_logging(actor="verifier", stream=out)
    # When our code logs through structlog and a library through stdlib logging (%s style)
    get_logger().info("handled", n=1)
    logging.getLogger("hypercorn.error").warning("%s on %s: %d", "bind failed", "127.0.0.1", 98)
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("transformers").error("could not load", exc_info=True)
    # Then every line is JSON, the library's message formatted, with level and logger name
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [line["event"] for line in lines] == [
        "handled", "bind failed on 127.0.0.1: 98", "could not load"
    ]
    assert lines[1]["level"] == "warning" and lines[1]["logger"] == "hypercorn.error"
    assert all(line["actor"] == "verifier" and "timestamp" in line for line in lines)
    assert "ValueError: boom" in lines[2]["exception"]


def test_an_actor_process_log_has_only_json_lines() -> None:
    # Given a process set up as an actor (its stderr is its log file under `streamrl up`)
    code = (
        "import logging, warnings\n"
        "from streamrl.runtime.logs import configure_logging, get_logger\n"
        "configure_logging(actor='generator')\n"
        "get_logger().info('started')\n"
        "logging.getLogger('httpx').warning('HTTP Request: %s %s', 'GET', 'http://x/health')\n"
        "warnings.warn('deprecated thing')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)  # fmt: skip
    lines = [json.loads(line) for line in done.stderr.splitlines()]
    assert [line["event"] for line in lines][:2] == ["started", "HTTP Request: GET http://x/health"]
    assert "deprecated thing" in lines[2]["event"] and lines[2]["logger"] == "py.warnings"
