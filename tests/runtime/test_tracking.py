"""runtime.tracking: a backend that fails to log is logged once and left out; the others go on."""

from __future__ import annotations

from pathlib import Path

import structlog
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from streamrl.config.schema import load_config
from streamrl.runtime.tracking import open_trackers


def test_a_backend_that_fails_to_log_is_left_out_and_the_others_go_on(tmp_path: Path) -> None:
    config = load_config(None, ["tracking.backends=['wandb','tensorboard']",
                                f"tracking.log_dir='{tmp_path}'", "tracking.run_name='r'"])
    trackers = open_trackers(config)
    assert trackers.names == ["wandb", "tensorboard"]
    # Given the wandb run finished under the tracker (wandb refuses a log to it)
    wandb_tracker = trackers.trackers[0]
    wandb_tracker.run.finish()  # type: ignore[attr-defined]
    # When two steps are logged
    with structlog.testing.capture_logs() as logs:
        trackers.log(1, {"learner/loss": 0.5})
        trackers.log(2, {"learner/loss": 0.25})
    trackers.close()
    # Then wandb's refusal was logged once and it was left out; TensorBoard has both steps
    failed = [e for e in logs if e["event"].startswith("tracker failed")]
    assert [(e["backend"], e["call"]) for e in failed] == [("wandb", "log")]
    assert "finished" in failed[0]["error"]
    acc = EventAccumulator(str(tmp_path / "tensorboard" / "r"))
    acc.Reload()
    assert {e.step: e.value for e in acc.Scalars("learner/loss")} == {1: 0.5, 2: 0.25}
