"""``streamrl report`` with 100+ domains: one heatmap row per domain instead of 100 lines on
one axis, and forgetting on an eval-only domain flagged."""

from __future__ import annotations

import random
from collections import defaultdict
from pathlib import Path

from PIL import Image

from streamrl.cli.report import LINES_UP_TO, RunData, charts, forgotten, summary


def synthetic(domains: int, versions: int) -> RunData:
    """``domains`` trained domains with rising train and held-out reward over ``versions``
    policy versions, plus the eval-only ``general`` falling from 0.8 to 0.5."""
    rng = random.Random(0)
    data = RunData()
    for d in range(domains):
        name = f"gym-{d:03d}"
        data.reward[name] = defaultdict(list)
        data.evals[name] = defaultdict(list)
        for v in range(versions):
            data.reward[name][v] = [min(1.0, rng.random() * 0.3 + v / versions)] * 4
            data.evals[name][v] = [min(1.0, rng.random() * 0.2 + v / versions)]
    data.evals["general"] = defaultdict(list, {v: [0.8 - 0.3 * v / (versions - 1)]
                                               for v in range(versions)})
    return data


def test_120_domains_draw_as_a_heatmap_with_a_row_each(tmp_path: Path) -> None:
    # Given 120 trained domains and one eval-only domain that forgets, over 6 versions
    data = synthetic(120, 6)
    # When the report draws its charts
    written = charts(data, tmp_path, margin=0.1)
    # Then both reward charts are heatmaps tall enough for a legible row per domain
    assert {"reward.png", "eval.png"} <= set(written)
    assert len(data.evals) > LINES_UP_TO
    for name in ("reward.png", "eval.png"):
        width, height = Image.open(tmp_path / name).size
        assert height >= 121 * 10, (name, height)  # >= 10 px per domain row at dpi 100
        assert width <= 1000
    # And the forgetting eval-only domain is flagged, in the summary too
    assert forgotten(data, 0.1) == {"general"}
    text = summary("run", data, written, margin=0.1)
    assert "| general | no (eval only) | 0.800 (v0) | 0.500 (v5) | -0.300 **forgetting** |" in text
    assert text.count("**forgetting**") == 1


def test_a_drop_within_the_margin_is_not_forgetting() -> None:
    data = synthetic(3, 4)
    assert forgotten(data, 0.5) == set()
    assert forgotten(data, 0.2) == {"general"}
