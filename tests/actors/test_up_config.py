"""``streamrl up`` hands its children the merged config as one file, not ``--set`` strings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import trio

from streamrl.cli.main import _public
from streamrl.cli.up import Child, _children, _serve_models, write_child_config
from streamrl.config.schema import load_config
from streamrl.runtime.priority import autogroups_enabled


def test_children_load_exactly_the_merged_config_of_up(tmp_path: Path) -> None:
    # Given up's config: a file, command-line overrides and serve-model servers
    config = load_config("configs/tiny.toml", [
        f"run.work_dir={tmp_path}", "run.name=cfg", "run.redis_url=redis://:pw@127.0.0.1:1/0",
        "learner.lr=3e-5", "up.serve_models=1",
    ])  # fmt: skip
    # When up writes it for its children
    config, servers = _serve_models(config)
    path = write_child_config(config)
    children = _children(config, path, {})
    # Then no child gets a --set, each loads the file, and the Redis password is not in it
    assert path == config.run.path / "config.json" and len(servers) == 1
    assert "pw" not in path.read_text()
    for child in children:
        assert "--set" not in child.argv
        assert child.argv[-2:] == ["--config", str(path)]
    # And what a child loads (file + its environment) is up's config, as `streamrl config` shows
    shown = subprocess.run(
        [sys.executable, "-m", "streamrl", "config", "--config", str(path)],
        env=children[0].env, capture_output=True, text=True, timeout=60, check=True,
    )
    assert json.loads(shown.stdout) == _public(config)
    assert config.generator.engine == "sglang" and config.learner.lr == 3e-5


async def test_the_decoding_processes_run_at_up_decode_nice(tmp_path: Path) -> None:
    # Given up.decode_nice, with the generators decoding in-process and then through servers
    base = [f"run.work_dir={tmp_path}", "run.name=nice", "up.decode_nice=7"]
    own = load_config("configs/tiny.toml", base)
    served, servers = _serve_models(load_config("configs/tiny.toml", [*base, "up.serve_models=1"]))
    # Then the processes that decode get it, and no other child does
    niced = {c.actor: c.nice for c in _children(own, tmp_path / "c.json", {})}
    assert niced["generator"] == 7 and niced["learner"] == niced["scheduler"] == 0
    assert [s.nice for s in servers] == [7]
    assert all(c.nice == 0 for c in _children(served, tmp_path / "c.json", {}))
    # And a child started with it runs at that nice value (above up's own), and so does its
    # session, where the kernel shares the CPUs between sessions first (autogroups)
    groups = autogroups_enabled()
    child = Child("generator", 0, [sys.executable, "-c", REPORT_NICE],
                  {"WAIT_GROUP": "1"} if groups else {}, tmp_path / "g.log", nice=7)
    with trio.fail_after(60):
        await child.serve()
    own, session = child.log_path.read_text().split()
    assert child.finished and int(own) == min(os.nice(0) + 7, 19)
    assert session == "7" or not groups


REPORT_NICE = """
import os, pathlib, time
group = pathlib.Path("/proc/self/autogroup")
deadline = time.monotonic() + 10  # up sets the session's value just after the start
while os.environ.get("WAIT_GROUP") and group.read_text().split()[-1] == "0" \
        and time.monotonic() < deadline:
    time.sleep(0.02)
print(os.nice(0), group.read_text().split()[-1] if group.exists() else "none")
"""
