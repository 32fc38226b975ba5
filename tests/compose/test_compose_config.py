"""compose.yaml (and its host-network override) as the compose implementation resolves it,
and what the project image installs: checks that need no Docker engine.

- a compose run keeps its trajectories: an ``archiver`` service runs ``streamrl run
  archiver`` as its own ACL user on the data volume (and the project image it runs from has
  pyarrow, which the archiver writes Parquet with);
- the gpu profile mounts the models directory into the scheduler, which loads the tokenizer
  of ``model.spec`` from it (``scheduler.drop_overlong``);
- the vllm profile runs vLLM's image with every flag and variable ``streamrl up`` starts vLLM
  with (inference/vllm_server.py) but the machine's, the worker extension mounted from the
  checkout and the weights volume where the learner writes it, and configs/compose-vllm.toml
  names that server.

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

from streamrl.config.schema import load_config
from streamrl.inference import vllm_server

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
@pytest.mark.parametrize("profile", ["cpu", "gpu", "vllm"])
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


@pytest.mark.parametrize("profile", ["gpu", "vllm"])
def test_the_gpu_profiles_mount_the_models_into_the_scheduler(profile: str) -> None:
    services = _resolved("compose.yaml", profile=profile, MODELS_DIR="/srv/models")["services"]
    for name in ("scheduler", "generator"):  # both load the tokenizer of model.spec
        assert "/srv/models:/models" in {m.removesuffix(":ro") for m in
                                         _mounts(services[name])}, name  # fmt: skip


def _mount(service: dict[str, Any], target: str) -> tuple[str, bool] | None:
    """(source, read-only) of the mount at ``target`` (1.29 prints strings, v2 mappings)."""
    for v in service.get("volumes", []):
        if isinstance(v, str):
            source, _, rest = v.partition(":")
            path, _, mode = rest.partition(":")
            if path == target:
                return source, mode == "ro"
        elif v["target"] == target:
            return v["source"], bool(v.get("read_only"))
    return None


def _options(argv: list[str]) -> dict[str, str | None]:
    """``--flag value`` and bare ``--flag`` (None) of a command line."""
    return {a: (argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None)
            for i, a in enumerate(argv) if a.startswith("--")}


def test_the_vllm_profile_starts_vllm_as_streamrl_up_does(monkeypatch: pytest.MonkeyPatch) -> None:
    # Given the vllm profile with its config, and the command line `streamrl up` starts vLLM with
    resolved = _resolved("compose.yaml", profile="vllm", MODELS_DIR="/srv/models",
                         MODEL_NAME="Qwen2.5-0.5B-Instruct",
                         STREAMRL_CONFIG="./configs/compose-vllm.toml")
    services = resolved["services"]
    vllm = services["vllm"]
    monkeypatch.setattr(vllm_server, "vllm_executable", lambda: Path("vllm"))
    local = _options(vllm_server.vllm_command("/models/m", 8000))
    # Then the server runs vLLM's image of the pinned version, on a GPU, with every flag the
    # client needs of it (all but the machine's) and at least one batch of the longest sequence
    assert vllm["image"] == f"vllm/vllm-openai:v{vllm_server.VLLM_VERSION}"
    assert vllm["entrypoint"] == ["vllm", "serve"]
    argv = vllm["command"]
    assert argv[0] == "/models/Qwen2.5-0.5B-Instruct"
    options = _options(argv)
    missing = {f: v for f, v in local.items()
               if f not in vllm_server.MACHINE_FLAGS and options.get(f, "absent") != v}
    assert missing == {}, f"compose's vllm command lacks {missing}"
    assert int(options["--max-num-batched-tokens"] or 0) >= int(options["--max-model-len"] or 1)
    [gpu] = vllm["deploy"]["resources"]["reservations"]["devices"]
    assert gpu["capabilities"] == ["gpu"] and len(gpu["device_ids"]) == 1
    # the environment, and the worker extension on its PYTHONPATH, mounted from the checkout
    env = vllm["environment"]
    assert vllm_server.SERVER_ENVIRONMENT.items() <= env.items()
    module = options["--worker-extension-cls"].partition(".")[0]  # type: ignore[union-attr]
    assert _mount(vllm, env["PYTHONPATH"]) == (str(vllm_server.EXTENSION_DIR), True)
    assert (vllm_server.EXTENSION_DIR / f"{module}.py").is_file()
    # the weights volume at the path the learner writes each version to (run.work_dir)
    assert _mount(vllm, "/data") == ("data", True)
    assert _mount(services["learner-gpu"], "/data") == ("data", False)
    # And the config it mounts (the one every actor reads) names that server, engine vllm
    source = _mount(services["generator"], "/etc/streamrl/streamrl.toml")
    assert source is not None and Path(source[0]) == ROOT / "configs" / "compose-vllm.toml"
    config = load_config(source[0], ["learner.device=cuda"])  # as learner-gpu runs it
    assert config.generator.engine == "vllm" and not config.generator.router_url
    assert config.run.path.is_relative_to("/data")
    assert config.generator.server_urls == [f"http://vllm:{options['--port']}"]
    # and the profile starts no other inference server or learner (1.29 prints every service)
    others = ("serve-model", "sglang", "sglang-router", "learner")
    assert [n for n in others if "vllm" in services.get(n, {}).get("profiles", [])] == []
    assert "vllm" in services["learner-gpu"]["profiles"]


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
