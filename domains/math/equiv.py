"""Answer equivalence for math: numeric first, then symbolic (sympy), under our own deadline.

Guarantees:
- ``equivalent(answer, expected)`` returns a bool and never hangs, nor raises for the answer:
  a reference it cannot check (neither a number nor a screened expression, or one sympy
  cannot parse) is :class:`~streamrl.domains.base.VerifierFailed` (issue 32 item 3). The symbolic
  check runs in a persistent worker *process* (sympy imported once) with a deadline per
  call; a worker that misses it is killed (SIGKILL) and replaced, and the answer counts
  as wrong. No SIGALRM, no thread left spinning.
- what reaches sympy is screened first: at most ``MAX_CHARS`` characters, only digits,
  the operators ``+-*/^()``, ``.``, ``,`` and spaces, and identifiers from a short
  allow-list (``x``, ``sqrt``, ``pi``...), no exponent towers or exponents over
  ``MAX_EXPONENT``; it is parsed with a namespace of exactly those names (sympy's
  ``parse_expr`` evaluates Python, so builtins such as ``open`` must never be reachable).
  The worker has an address-space limit, so a blow-up that slips through dies alone.
- numeric equality: relative tolerance 1e-6 (absolute 1e-9 near zero); ``nan``/``inf`` are
  never equal to anything.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import re
import threading
from fractions import Fraction
from multiprocessing.connection import Connection
from typing import Any

from streamrl.domains.base import VerifierFailed

MAX_CHARS = 200
MAX_EXPONENT = 64
DEADLINE_S = 2.0
WORKER_MEMORY_MB = 1024

NAMES = ("x", "y", "z", "n", "t", "sqrt", "pi", "E", "I", "sin", "cos", "tan", "log", "exp",
         "Rational")
_ALLOWED = re.compile(r"^[0-9a-zA-Z+\-*/^()., ]*$")
_IDENT = re.compile(r"[A-Za-z_]+")
_POWER = re.compile(r"(\*\*|\^)\s*\(?\s*(\d+)")
_TOWER = re.compile(r"(\*\*|\^)[^*^]*(\*\*|\^)")


def screen(text: str) -> str | None:
    """The expression normalised for parsing, or None if it must not reach the parser."""
    text = text.strip().replace("^", "**").replace("\u2212", "-")
    if not text or len(text) > MAX_CHARS or not _ALLOWED.match(text) or "__" in text:
        return None
    if any(name not in NAMES for name in _IDENT.findall(text)):
        return None
    if _TOWER.search(text) or any(int(m.group(2)) > MAX_EXPONENT for m in _POWER.finditer(text)):
        return None
    return text


def as_number(text: str) -> float | None:
    """A plain number (int, decimal, fraction ``a/b``, thousands commas), else None."""
    t = text.strip().replace(",", "")
    if not re.fullmatch(r"[-+]?\d+(\.\d+)?(/[-+]?\d+(\.\d+)?)?", t) or len(t) > 40:
        return None
    try:
        return float(Fraction(t))
    except (ValueError, ZeroDivisionError):
        return None


def numbers_equal(a: float, b: float) -> bool:
    if not (math.isfinite(a) and math.isfinite(b)):
        return False
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)


def _worker(conn: Connection) -> None:  # runs in the child process
    import resource

    limit = WORKER_MEMORY_MB << 20
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    import sympy
    from sympy.parsing.sympy_parser import (
        implicit_multiplication,
        parse_expr,
        standard_transformations,
    )

    namespace: dict[str, Any] = {name: getattr(sympy, name) for name in NAMES
                                 if name not in "xyznt"}
    namespace.update({s: sympy.Symbol(s) for s in "xyznt"})
    for name in ("Symbol", "Integer", "Float", "Rational"):  # what parse_expr's code calls
        namespace[name] = getattr(sympy, name)
    namespace["__builtins__"] = {}
    transforms = (*standard_transformations, implicit_multiplication)
    while True:
        a, b = conn.recv()
        try:
            eb = parse_expr(b, local_dict={}, global_dict=dict(namespace),
                            transformations=transforms)
        except Exception as exc:  # the reference: the check's failure, said as a str
            conn.send(f"sympy cannot parse the reference {b!r}: {type(exc).__name__}: {exc}")
            continue
        try:
            ea = parse_expr(a, local_dict={}, global_dict=dict(namespace),
                            transformations=transforms)
            diff = sympy.simplify(ea - eb)
            conn.send(bool(diff == 0))
        except Exception:  # anything the answer did to the parser: not equivalent
            conn.send(False)


class SymbolicChecker:
    """One worker process, restarted after a missed deadline or a crash. Thread-safe."""

    def __init__(self, deadline_s: float = DEADLINE_S) -> None:
        self.deadline_s = deadline_s
        self._lock = threading.Lock()
        self._proc: Any = None
        self._conn: Connection | None = None
        self.restarts = 0

    def _start(self) -> Connection:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=_worker, args=(child,), daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent
        return parent

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(5)
            self.restarts += 1
        if self._conn is not None:
            self._conn.close()
        self._proc = self._conn = None

    def equal(self, a: str, b: str, first_call_grace_s: float = 20.0) -> bool:
        with self._lock:
            fresh = self._conn is None
            conn = self._conn or self._start()
            try:
                conn.send((a, b))
                # a fresh worker first imports sympy (seconds): that is not the answer's time
                if conn.poll(self.deadline_s + (first_call_grace_s if fresh else 0.0)):
                    reply = conn.recv()
                    if isinstance(reply, str):  # the reference does not parse
                        raise VerifierFailed(f"math: {reply}"[:300])
                    return bool(reply)
            except (EOFError, OSError, BrokenPipeError):
                pass
            self._kill()
            return False

    def close(self) -> None:
        with self._lock:
            self._kill()


_checker: SymbolicChecker | None = None


def checker() -> SymbolicChecker:
    global _checker
    if _checker is None:
        _checker = SymbolicChecker()
    return _checker


def equivalent(answer: str, expected: str, symbolic: SymbolicChecker | None = None) -> bool:
    a, b = as_number(answer), as_number(expected)
    if a is not None and b is not None:
        return numbers_equal(a, b)
    sa, sb = screen(answer), screen(expected)
    if b is None and sb is None:
        raise VerifierFailed(f"math: cannot check the reference {expected!r}: neither a number "
                             "nor an expression the screen lets through"[:300])
    if sa is None or sb is None:
        return False
    if sa.replace(" ", "") == sb.replace(" ", ""):
        return True
    return (symbolic or checker()).equal(sa, sb)
