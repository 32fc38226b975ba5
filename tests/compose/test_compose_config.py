"""compose.yaml (and its host-network override) as the compose implementation resolves it,
and what the project image installs: checks that need no Docker engine.

- a compose run keeps its trajectories: an ``archiver`` service runs ``streamrl run
  archiver`` as its own ACL user on the data volume (and the project image it runs from has
  pyarrow, which the archiver writes Parquet with);
- the gpu profile mounts the models directory into the scheduler, which loads the tokenizer
  of ``model.spec`` from it (``scheduler.drop_overlong``).

Needs Debian's docker-compose 1.29 (``docker-compose`` on PATH, or $STREAMRL_COMPOSE); skips
without it, except under $CI.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = os.environ.get("STREAMRL_COMPOSE", "docker-compose").split()
ROLES = ("SCHEDULER", "GENERATOR", "EXECUTOR", "VERIFIER", "LEARNER", "MONITOR", "ARCHIVER")


def _resolved(*files: str, profile: str, **env: str) -> dict[str, Any]:
    """``<compose> -f FILE... --profile PROFILE config``, parsed."""
    if shutil.which(COMPOSE[0]) is None:
        if os.environ.get("CI"):
            pytest.fail(f"{COMPOSE[0]} is not installed")
        pytest.skip(f"{COMPOSE[0]} is not installed (apt-get install docker-compose)")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("STREAMRL_")}
    environ |= {f"STREAMRL_PASSWORD_{r}": f"pw-{r.lower()}" for r in ROLES}
    environ |= {"REDIS_PASSWORD": "pw-redis", **env}
    argv = [*COMPOSE, *(a for f in files for a in ("-f", f)), "--profile", profile, "config"]
    done = subprocess.run(argv, cwd=ROOT, env=environ, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    resolved: dict[str, Any] = yaml.safe_load(done.stdout)
    return resolved


def _mounts(service: dict[str, Any]) -> set[str]:
    return {v if isinstance(v, str) else f"{v['source']}:{v['target']}"
            for v in service.get("volumes", [])}  # fmt: skip


@pytest.mark.parametrize("files", [("compose.yaml",), ("compose.yaml", "compose.host.yaml")],
                         ids=["compose", "host-network"])  # fmt: skip
@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_a_compose_run_archives_its_trajectories(files: tuple[str, ...], profile: str) -> None:
    services = _resolved(*files, profile=profile)["services"]
    archiver = services.get("archiver")
    assert archiver is not None, f"no archiver service: {sorted(services)}"
    assert archiver["command"][:2] == ["run", "archiver"]
    # its own ACL user's password only, the run's data volume (archive under run.work_dir)
    own = {k for k in archiver["environment"] if k.startswith("STREAMRL_PASSWORD_")}
    assert own == {"STREAMRL_PASSWORD_ARCHIVER"}
    assert any(m.startswith("data:/data") for m in _mounts(archiver))
    assert archiver["image"] == services["scheduler"]["image"]  # the project image
    assert "acl" in archiver["depends_on"]
    if len(files) > 1:  # the host network: Redis on 127.0.0.1, the host config
        assert archiver["network_mode"] == "host"
        assert archiver["environment"]["STREAMRL_REDIS_URL"].startswith("redis://127.0.0.1:")


def test_the_gpu_profile_mounts_the_models_into_the_scheduler() -> None:
    services = _resolved("compose.yaml", profile="gpu", MODELS_DIR="/srv/models")["services"]
    for name in ("scheduler", "generator"):  # both load the tokenizer of model.spec
        assert "/srv/models:/models" in {m.removesuffix(":ro") for m in
                                         _mounts(services[name])}, name  # fmt: skip


def test_the_project_image_installs_pyarrow_for_the_archiver(tmp_path: Path) -> None:
    # docker/Dockerfile installs what `docker/lock.py image-deps` lists; the offline image
    # (docker/build_offline.sh) what `docker/lock.py requirements` writes
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert "lock.py image-deps" in dockerfile
    listed = subprocess.run([sys.executable, "docker/lock.py", "image-deps"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    out = tmp_path / "requirements.txt"
    subprocess.run([sys.executable, "docker/lock.py", "requirements", str(out)], cwd=ROOT,
                   check=True)  # fmt: skip
    for requirements in (listed, out.read_text().split()):
        assert any(r.startswith("pyarrow") for r in requirements), requirements
