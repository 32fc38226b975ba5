"""Versioned policy weights on disk, in the one layout every actor loads.

Guarantees:
- ``root/v{version:06d}`` is a complete Hugging Face directory (``config.json``,
  ``model.safetensors``, tokenizer files) or does not exist: it is written to a hidden
  temporary directory, fsynced, and renamed into place, so a reader never sees a half
  written version, even after a crash;
- pruning keeps the ``keep_last`` newest versions and never deletes the version just
  written. A reader that has not yet opened a pruned version gets ``FileNotFoundError``
  and should reload :func:`latest_version`; one that has opened (memory-mapped) the file
  keeps reading it safely;
- :func:`load_state_into` updates an existing model in place (same parameter objects, so
  optimisers, compiled graphs and tied weights keep pointing at the right tensors) and
  refuses files whose names or shapes do not match the model.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
_VERSION_DIR = re.compile(r"^v(\d{6,})$")


def version_dir(root: Path, version: int) -> Path:
    return Path(root) / f"v{version:06d}"


def list_versions(root: Path) -> list[int]:
    """Complete versions under ``root``, oldest first (temporary directories are hidden)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = (_VERSION_DIR.match(p.name) for p in root.iterdir() if p.is_dir())
    return sorted(int(m.group(1)) for m in found if m)


def latest_version(root: Path) -> int | None:
    versions = list_versions(root)
    return versions[-1] if versions else None


def save_weights(
    model: Any,
    tokenizer: Path | str | Any,
    root: Path,
    version: int,
    keep_last: int,
    extra: Callable[[Path], None] | None = None,
) -> Path:
    """Write ``model`` (and the tokenizer) as ``root/v{version:06d}``; return that path.

    ``tokenizer`` is either a directory to copy the tokenizer files from (the base model's)
    or a tokenizer object with ``save_pretrained``. Raises ``FileExistsError`` if the
    version already exists: versions are immutable. ``extra(directory)`` writes further
    files (the optimiser state) into the version before it appears.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    target = version_dir(root, version)
    if target.exists():
        raise FileExistsError(f"weights version {version} already exists at {target}")

    # One learner writes a root; leftovers of a writer that crashed mid-save go first.
    for leftover in root.glob(f".{target.name}.*.tmp"):
        shutil.rmtree(leftover, ignore_errors=True)
    tmp = root / f".{target.name}.{os.getpid()}.tmp"
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        if isinstance(tokenizer, (str, Path)):
            for name in TOKENIZER_FILES:
                if (Path(tokenizer) / name).exists():
                    shutil.copyfile(Path(tokenizer) / name, tmp / name)
        else:
            tokenizer.save_pretrained(tmp)
        if extra is not None:
            extra(tmp)
        for path in tmp.iterdir():
            _fsync(path)
        _fsync(tmp)
        tmp.rename(target)
        _fsync(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

    for old in list_versions(root)[:-keep_last]:
        if old != version:
            shutil.rmtree(version_dir(root, old), ignore_errors=True)
    return target


def load_state_into(model: Any, path: Path | str) -> None:
    """Copy the tensors of ``path`` (a version directory or a ``.safetensors`` file) into
    ``model``'s parameters and buffers, in place.

    Tied weights (``lm_head.weight`` sharing ``embed_tokens.weight``) are absent from the
    file and need no copy: they alias a tensor that is in it. Any other missing or
    unexpected name, or a shape mismatch, raises ``KeyError`` / ``ValueError`` before a
    single tensor is changed.
    """
    path = Path(path)
    file = path / WEIGHTS_FILE if path.is_dir() else path
    state = model.state_dict()
    with safe_open(str(file), framework="pt") as f:
        names = set(f.keys())
        unexpected = names - state.keys()
        loaded_ptrs = {state[n].data_ptr() for n in names - unexpected}
        missing = {n for n in state.keys() - names if state[n].data_ptr() not in loaded_ptrs}
        if unexpected or missing:
            raise KeyError(
                f"{file}: unexpected {sorted(unexpected)[:5]}, missing {sorted(missing)[:5]}"
            )
        for name in names:
            shape = tuple(f.get_slice(name).get_shape())
            if shape != tuple(state[name].shape):
                raise ValueError(f"{file}: {name} has shape {shape}, model has {state[name].shape}")
        with torch.no_grad():
            for name in names:
                state[name].copy_(f.get_tensor(name))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
