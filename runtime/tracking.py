"""Experiment tracking: scalars at a step, written to TensorBoard, wandb (offline) and trackio.

Guarantees:
- nothing leaves the machine: TensorBoard writes event files, wandb runs in offline mode
  (``mode="offline"`` and ``WANDB_MODE=offline``; ``wandb sync`` uploads later, by hand),
  trackio writes its local SQLite store (no Space, no server);
- a backend that fails (to open, to log, to close) is logged once with its error and left
  out from then on; the others and the caller carry on: tracking never stops a run.

Each backend is one small adapter with ``log(step, scalars)`` and ``close()``; the package
is imported when the backend is opened, so a run without tracking never loads it.
:class:`Trackers` fans out to the open adapters. Opening and closing block for a while
(wandb starts and stops its local service): the monitor does both in a worker thread; a
``log`` is a quick local write or hand-off and is called in place.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import structlog

from streamrl.config.schema import Config

log = structlog.get_logger("streamrl.tracking")


class Tracker(Protocol):
    name: str

    def log(self, step: int, scalars: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    """Event files under ``<log_dir>/tensorboard/<run>`` (``tensorboard --logdir``)."""

    name = "tensorboard"

    def __init__(self, log_dir: Path, run: str) -> None:
        from torch.utils.tensorboard import SummaryWriter  # the tensorboard package's writer

        self.writer = SummaryWriter(log_dir=str(log_dir / "tensorboard" / run))

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """An offline wandb run under ``<log_dir>/wandb`` (``wandb sync <its offline-run dir>``).
    Every row carries ``policy_step``, the x-axis of every series: the held-out reward of a
    round arrives after later steps, and wandb's own step only goes up."""

    name = "wandb"

    def __init__(self, log_dir: Path, project: str, run: str, hparams: dict[str, Any]) -> None:
        os.environ["WANDB_MODE"] = "offline"  # and mode= below: never the network
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        (log_dir / "wandb").mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            mode="offline", dir=str(log_dir / "wandb"), project=project, name=run,
            config=hparams, reinit="create_new",
            settings=wandb.Settings(console="off", x_disable_stats=True),
        )  # fmt: skip
        self.run.define_metric("policy_step")
        self.run.define_metric("*", step_metric="policy_step")

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self.run.log({"policy_step": step, **scalars})

    def close(self) -> None:
        import wandb

        self.run.finish()
        wandb.teardown()  # its service process (wandb-core) ends with the run, not the process


class TrackioTracker:
    """trackio's local store, ``<log_dir>/trackio/<project>.db`` (``trackio show``); a Space
or server named in the environment (``TRACKIO_SPACE_ID``, ``TRACKIO_SERVER_URL``) is ignored.
    trackio reads its directory (``TRACKIO_DIR``) once, when first imported, so one process
    tracks into one directory."""

    name = "trackio"

    def __init__(self, log_dir: Path, project: str, run: str, hparams: dict[str, Any]) -> None:
        where = log_dir / "trackio"
        os.environ.setdefault("TRACKIO_DIR", str(where))
        for remote in ("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL"):  # local store only
            os.environ.pop(remote, None)
        import trackio.utils

        if Path(trackio.utils.TRACKIO_DIR).resolve() != where.resolve():
            raise RuntimeError(f"trackio already writes to {trackio.utils.TRACKIO_DIR} in this "
                               f"process (TRACKIO_DIR), not {where}")
        where.mkdir(parents=True, exist_ok=True)
        import trackio

        self.run = trackio.init(project=project, name=run, config=hparams,
                                auto_log_cpu=False, auto_log_gpu=False)

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self.run.log(dict(scalars), step=step)

    def close(self) -> None:
        self.run.finish()


class Trackers:
    """The open backends; one that fails is logged and dropped, never raised."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.trackers]

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        for t in list(self.trackers):
            self._guard(t, "log", partial(t.log, step, scalars))

    def close(self) -> None:
        for t in list(self.trackers):
            self._guard(t, "close", t.close)
        self.trackers = []

    def _guard(self, tracker: Tracker, what: str, call: Callable[[], None]) -> None:
        try:
            call()
        except Exception as exc:  # a tracker's failure becomes a log line, never the run's
            log.error("tracker failed; left out from now on", backend=tracker.name, call=what,
                      error=repr(exc))
            self.trackers.remove(tracker)


def tracking_dir(config: Config) -> Path:
    return Path(config.tracking.log_dir) if config.tracking.log_dir else (
        config.run.path / "tracking")


def open_trackers(config: Config, hparams: dict[str, Any] | None = None) -> Trackers:
    """The backends of ``config.tracking`` that open; one that does not is logged, left out."""
    spec = config.tracking
    log_dir, run = tracking_dir(config), spec.run_name or config.run.name
    hparams = hparams or {}
    makers: dict[str, Callable[[], Tracker]] = {
        "tensorboard": lambda: TensorBoardTracker(log_dir, run),
        "wandb": lambda: WandbTracker(log_dir, spec.project, run, hparams),
        "trackio": lambda: TrackioTracker(log_dir, spec.project, run, hparams),
    }
    opened: list[Tracker] = []
    for backend in spec.backends:
        try:
            opened.append(makers[backend]())
        except Exception as exc:  # a backend that cannot open is logged; the others track
            log.error("tracker did not open; left out", backend=backend, dir=str(log_dir),
                      error=repr(exc))
    if opened:
        log.info("tracking", backends=[t.name for t in opened], dir=str(log_dir))
    return Trackers(opened)
