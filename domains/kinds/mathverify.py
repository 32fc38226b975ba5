"""The ``math_verify`` kind: the final answer is mathematically equivalent to the reference,
judged by Hugging Face's ``math-verify`` (LaTeX and plain expressions, sets, intervals,
equations; sympy underneath), not by parsing of ours.

Only the final answer is judged (:func:`answers.final_answer`: the last ``\\boxed{}``, else
the last ``Answer:`` line, else the last line; at most ``MAX_ANSWER`` characters), so a
completion that lists candidates (``\\boxed{3} \\boxed{1/2}``, ``1/2 or 3``: a set, or the
last one) is not equivalent to one value. Reward is 1.0 or 0.0; anything math-verify cannot
parse is 0.0.

Deadline: math-verify's own timeouts use SIGALRM (main thread only), so they are off here;
the bound is the verifier's scorer process (``verifier.score_timeout_s``, killed past it).
Options: ``float_rounding`` (decimal places numbers are compared at, default 6).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from streamrl.domains.base import NO_SANDBOX, SandboxSpec, VerifierFailed
from streamrl.domains.kinds import Record, Verifier, kind
from streamrl.domains.kinds.answers import check_options, final_answer
from streamrl.sandbox.base import ExecRequest, ExecResult

logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout disabled" on every call


def _as_latex(text: str) -> str:
    return text if "$" in text or "\\boxed" in text else f"${text}$"


@dataclass(frozen=True)
class MathVerify:
    float_rounding: int = 6
    sandbox: SandboxSpec = NO_SANDBOX

    def check_item(self, item: Record) -> None:
        if item.answer is None or not str(item.answer).strip():
            raise ValueError(f"item {item.id!r}: no answer (math_verify compares to one)")

    def exec_request(self, item: Record, completion: str) -> ExecRequest | None:
        return None

    def score(self, item: Record, completion: str, result: ExecResult | None) -> float:
        """1 if the final answer equals the reference, 0 if not (or none, or it does not
        parse). :class:`VerifierFailed` if the reference itself does not parse or math-verify
        raised: the check failed, not the answer."""
        from math_verify import parse, verify  # imported once per scorer process

        answer = final_answer(completion)
        if answer is None:
            return 0.0
        try:
            gold = parse(_as_latex(str(item.answer)), parsing_timeout=None)  # type: ignore[arg-type]
            if not gold:
                raise VerifierFailed(f"math-verify cannot parse the reference {item.answer!r}")
            got = parse(_as_latex(answer), parsing_timeout=None)  # type: ignore[arg-type]
            if not got:
                return 0.0
            same = verify(gold, got, float_rounding=self.float_rounding, timeout_seconds=None)
        except VerifierFailed:
            raise
        except Exception as exc:  # the verifier boundary: math-verify's failure is typed
            raise VerifierFailed(f"math-verify raised {type(exc).__name__}: {exc}"[:300]) from exc
        return 1.0 if same else 0.0


@kind("math_verify")
def math_verify(options: Mapping[str, Any]) -> Verifier:
    check_options("math_verify", options, {"float_rounding"})
    return MathVerify(int(options.get("float_rounding", 6)))
