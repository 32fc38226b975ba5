"""A task's repository as ``{relative path: bytes}``, and diffs applied to it.

Where the files come from (first that the item has): ``repo`` (inline, ``{path: text}``),
``repo_dir`` with ``base_commit`` (a git checkout: the files of that commit, whatever the
work tree holds; links and submodules left out), ``repo_dir`` alone (a directory snapshot:
its regular files, ``.git`` and links left out). Every path is a clean relative one (no
absolute path, no ``..``, no ``.git``); the size is capped (:class:`RepoTooBig`).

:func:`apply_diff` applies a unified diff with the standard tool set's exact semantics
(``domains/tools/standard``: all or nothing, exact context, no renames, creations and
deletions); a path outside the repository is refused. Never raises for what a diff holds:
:class:`~streamrl.domains.tools.standard.ToolRefused` is the one answer.
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from streamrl.domains.tools.standard import ToolRefused, apply_hunks, checked_path, parse_patch

MAX_BYTES = 64 << 20
MAX_FILES = 20_000
SKIP_DIRS = frozenset({".git", "__pycache__", ".pytest_cache", ".mypy_cache"})


class RepoTooBig(ValueError):
    pass


def clean_path(path: str) -> str:
    """``path`` as a clean relative path inside the repository, else ``ValueError``."""
    try:
        rel = checked_path(path)
    except ToolRefused as exc:
        raise ValueError(str(exc)) from None
    if ".git" in rel.split("/"):
        raise ValueError(f"{rel}: paths under .git are refused")
    return rel


def repo_files(source: Mapping[str, Any], max_bytes: int = MAX_BYTES) -> dict[str, bytes]:
    """The repository an item (its ``extra``) names: ``repo``, or ``repo_dir`` [+
    ``base_commit``]."""
    inline = source.get("repo")
    if inline is not None:
        if not isinstance(inline, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in inline.items()):
            raise ValueError("repo must be {path: text}")
        files = {clean_path(k): v.encode() for k, v in inline.items()}
    elif source.get("repo_dir"):
        root = Path(str(source["repo_dir"]))
        commit = str(source.get("base_commit") or "")
        files = git_files(root, commit, max_bytes) if commit else dir_files(root, max_bytes)
    else:
        raise ValueError("no repository: set repo ({path: text}) or repo_dir")
    _cap(files, max_bytes)
    return files


def _cap(files: Mapping[str, bytes], max_bytes: int) -> None:
    size = sum(len(v) for v in files.values())
    if size > max_bytes or len(files) > MAX_FILES:
        raise RepoTooBig(f"the repository holds {len(files)} files, {size} bytes: more than "
                         f"{MAX_FILES} files or {max_bytes} bytes")


def dir_files(root: Path, max_bytes: int = MAX_BYTES) -> dict[str, bytes]:
    if not root.is_dir():
        raise ValueError(f"{root}: not a directory")
    out: dict[str, bytes] = {}
    size = 0
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if SKIP_DIRS & set(rel.parts) or path.is_symlink() or not path.is_file():
            continue
        if any(p.is_symlink() for p in path.parents if root in p.parents):
            continue
        out[rel.as_posix()] = data = path.read_bytes()
        size += len(data)
        if size > max_bytes:
            raise RepoTooBig(f"{root}: more than {max_bytes} bytes")
    return out


def git_files(root: Path, commit: str, max_bytes: int = MAX_BYTES) -> dict[str, bytes]:
    """The regular files of ``commit`` in the git repository at ``root``."""
    def git(*args: str, data: bytes | None = None) -> bytes:
        try:
            return subprocess.run(["git", "-C", str(root), *args], input=data,
                                  capture_output=True, check=True, timeout=120).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            err = getattr(exc, "stderr", b"") or b""
            raise ValueError(f"{root}: git {args[0]}: {err.decode(errors='replace')[-300:] or exc}"
                             ) from None

    entries = []
    for entry in git("ls-tree", "-r", "-z", "--full-tree", commit).split(b"\0"):
        if not entry:
            continue
        meta, _, raw = entry.partition(b"\t")
        mode, kind, sha = meta.decode().split()
        if kind == "blob" and mode in ("100644", "100755"):
            entries.append((raw.decode("utf-8", "surrogateescape"), sha))
    out: dict[str, bytes] = {}
    if not entries:
        return out
    batch = git("cat-file", "--batch", data="".join(f"{sha}\n" for _, sha in entries).encode())
    pos, total = 0, 0
    for path, _ in entries:
        header_end = batch.index(b"\n", pos)
        size = int(batch[pos:header_end].split()[2])
        out[path] = batch[header_end + 1:header_end + 1 + size]
        pos, total = header_end + 1 + size + 1, total + size
        if total > max_bytes:
            raise RepoTooBig(f"{root}@{commit}: more than {max_bytes} bytes")
    return out


def apply_diff(files: Mapping[str, bytes], diff: str) -> dict[str, bytes]:
    """``files`` with the unified diff ``diff`` applied (a new mapping); ToolRefused."""
    out = dict(files)
    for f in parse_patch(diff):
        path = f.path
        if ".git" in path.split("/"):
            raise ToolRefused(f"{path}: paths under .git are refused")
        if f.old and path not in out:
            raise ToolRefused(f"{path}: not a file of the repository")
        if not f.old and path in out:
            raise ToolRefused(f"{path}: already exists (--- /dev/null creates a file)")
        try:
            text = out[path].decode() if f.old else ""
        except UnicodeDecodeError:
            raise ToolRefused(f"{path}: not UTF-8 text") from None
        new = apply_hunks(path, text, f.hunks)
        if f.new:
            out[path] = new.encode()
        elif new:
            raise ToolRefused(f"{path}: a deletion must remove every line")
        else:
            del out[path]
    return out


def make_diff(before: Mapping[str, bytes], after: Mapping[str, bytes]) -> str:
    """A unified diff (``--- a/path`` / ``+++ b/path``) from ``before`` to ``after``, which
    :func:`apply_diff` applies back."""
    import difflib

    out = []
    for path in sorted(set(before) | set(after)):
        old, new = before.get(path), after.get(path)
        if old == new:
            continue
        a = old.decode().splitlines(keepends=True) if old is not None else []
        b = new.decode().splitlines(keepends=True) if new is not None else []
        lines = list(difflib.unified_diff(a, b, f"a/{path}" if old is not None else "/dev/null",
                                          f"b/{path}" if new is not None else "/dev/null"))
        for line in lines:
            out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(out)
