"""Verifier kinds: how a completion is judged, apart from where the items come from.

A *kind* is a named factory ``kind(options) -> Verifier``: ``options`` is the kind's own
table in TOML (``[domain.<name>.verifier]``: a tolerance, the choices, a regex, the test
command...). A declared domain (``[domain.<name>]`` with ``kind = "..."`` and ``data =
"..."``, :mod:`streamrl.domains.declared`) pairs one verifier with one data set, so the same
kind serves many data sets in one run (``code-easy`` and ``code-hard``).

Every verifier keeps the domain contract (:mod:`streamrl.domains.base`): ``exec_request``
and ``score`` never raise for anything the model wrote; ``score`` is in [0, 1]; an item
lacks nothing the kind needs (:meth:`Verifier.check_item` refuses it at load time, naming
the field).

Items reach a verifier as a :class:`Record`: the fields a domain's ``fields`` mapping picked
out of a data row (``prompt``, ``answer``, ``tests``, ``id``) plus the whole row in
``extra``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import msgspec

from streamrl.domains.base import SandboxSpec
from streamrl.sandbox.base import ExecRequest, ExecResult


class Record(msgspec.Struct, frozen=True, kw_only=True):
    """One item of a declared domain, as it travels in ``Task.spec``."""

    id: str
    prompt: str
    answer: Any = None
    """The reference answer (text, a number, a choice letter...): what the kind compares to."""
    tests: Any = None
    """What a code kind runs: a test program (HumanEval/MBPP), a list of stdin/stdout cases,
    a task directory (Harbor layout)."""
    extra: dict[str, Any] = msgspec.field(default_factory=dict)
    """The rest of the row (entry point, choices, metadata, a generator's own answer data)."""


class TestResult(msgspec.Struct, frozen=True, kw_only=True):
    """One test of a code kind's run: ``status`` is ``pass``, ``fail`` or ``error`` (the
    ``stdio`` kind adds ``timeout`` and ``truncated``: only ``pass`` counts); ``message`` the
    assertion message, expected vs got, or the traceback / stderr tail, truncated."""

    name: str
    status: str
    message: str = ""


class Verifier(Protocol):
    @property
    def sandbox(self) -> SandboxSpec:
        """Where ``exec_request`` runs (``NO_SANDBOX`` for kinds that only read the text);
        read-only, so a frozen dataclass's field keeps the protocol."""
        ...

    def check_item(self, item: Record) -> None:
        """Raise ``ValueError`` naming what ``item`` lacks for this kind (load time)."""
        ...

    def exec_request(self, item: Record, completion: str) -> ExecRequest | None:
        """What to run in the sandbox for this completion (None: nothing)."""
        ...

    def score(self, item: Record, completion: str, result: ExecResult | None) -> float:
        """The reward in [0, 1]."""
        ...


KindFactory = Callable[[Mapping[str, Any]], Verifier]

KINDS: dict[str, KindFactory] = {}
"""Every verifier kind by name (filled by :func:`kind`, on import of its module)."""


def kind(name: str) -> Callable[[KindFactory], KindFactory]:
    """Register a verifier kind: ``@kind("numeric") def numeric(options): ...``."""

    def register(factory: KindFactory) -> KindFactory:
        if name in KINDS and KINDS[name] is not factory:
            raise ValueError(f"verifier kind {name!r} is already registered")
        KINDS[name] = factory
        return factory

    return register
