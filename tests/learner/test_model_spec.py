"""Model specs: the same names in ``model.spec`` and ``serve-model --model``, and a mistyped
one ends ``streamrl up`` with one line naming the valid ones, before anything is started."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from streamrl.models import model_limits, resolve_model

REPO = Path(__file__).resolve().parents[2]


def test_serve_models_short_name_is_a_model_spec_too() -> None:
    # serve-model --model smollm2 and model.spec = "smollm2-135m" name the same model
    assert model_limits("smollm2") == model_limits("smollm2-135m")
    assert resolve_model("tiny") == resolve_model("tiny")


@pytest.mark.parametrize(("spec", "says"), [
    ("smollm2-135", "unknown model spec 'smollm2-135': use 'smollm2-135m' (or 'smollm2'), "
                    "'tiny' or a Hugging Face directory"),
    ("/nonexistent/model", "model spec '/nonexistent/model': no such directory"),
])
def test_a_mistyped_model_spec_ends_up_with_one_line(tmp_path: Path, spec: str, says: str
                                                     ) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "streamrl", "up", "--config", "configs/tiny.toml",
         "--set", f"run.work_dir={tmp_path}", "--set", f"model.spec={spec}",
         "--max-minutes", "1"],
        capture_output=True, text=True, timeout=240, cwd=REPO,
    )
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.strip().splitlines() == [f"streamrl: {says}"], done.stderr[-3000:]
    assert not (tmp_path / "tiny" / "redis").exists()  # nothing was started
