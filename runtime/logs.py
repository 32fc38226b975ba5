"""structlog JSON logging, one line per event; episode ids bound per trio task. Records of
stdlib ``logging`` (libraries) come out as the same JSON lines."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, TextIO

import structlog

from streamrl.models import route_transformers_logging


def configure_logging(*, actor: str, level: str = "info", stream: TextIO | None = None) -> None:
    # Progress bars from model loading would interleave with the JSON lines.
    for var, value in (
        ("HF_HUB_DISABLE_PROGRESS_BARS", "1"),
        ("TRANSFORMERS_VERBOSITY", "error"),
        ("TQDM_DISABLE", "1"),
        ("TOKENIZERS_PARALLELISM", "false"),
    ):
        os.environ.setdefault(var, value)
    out = stream or sys.stderr
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    # stdlib logging (httpx, hypercorn, transformers, ...) renders through the same
    # processors: one JSON line per record, its %-formatted message as the event
    handler = logging.StreamHandler(out)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
    ))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.captureWarnings(True)  # warnings.warn(...) too, as logger py.warnings
    for noisy in ("httpx", "urllib3", "transformers", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if "transformers.utils.logging" in sys.modules:  # loaded already (else: when it loads)
        route_transformers_logging()
    structlog.configure(
        processors=[
            *shared,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(out),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(actor=actor)


def get_logger(**bound: Any) -> Any:
    return structlog.get_logger().bind(**bound)
