"""The arith demo domain: "Write a Python program that prints <something>".

Scoring (the verifier): the program is the first fenced code block of the completion
(```python / ```py / bare ```; an unclosed fence, as left by a length cut, runs to the end
of the text), or the whole completion when it has no fence. It runs as ``python3 main.py``
in the sandbox with a 2 s deadline. Reward, by default binary:

- 1.0 when the run did not time out and its stdout, stripped, equals the expected answer;
- 0.0 otherwise: no code, a crash, a timeout, or the wrong output;
- ``Arith(clean_run_credit=c)`` gives ``c`` instead of 0 to a program that exits 0 in time
  but prints the wrong thing (for experiments; the registered domain uses 0).

Why binary: a clean-run credit is gameable (``print(0)`` earns it on every item) and in
groups that are all wrong it pays for "prints something" rather than for the answer. The
reference calibration took the sum task from 0.06 to 1.0 in 18 steps with a binary reward,
and here greedy decoding already fails mostly by printing a wrong value (a clean-run credit
would reward that failure mode). At T=1, though, most failures crash (unfinished or garbled
code within the token budget), so if sampled groups turn out too sparse to learn from, a
lower sampling temperature is the first knob to try and ``clean_run_credit=0.1`` the second.

Calibration (``benchmarks/calibrate_demo.py``, figures in ``calibration.json``), 64 held-out
items, SmolLM2-135M-Instruct, 2 samples per item for the sampled rows:

    budget (new tokens)      32     48     64     80
    greedy                 0.06   0.17   0.30   0.30
    T=1                    0.01   0.02   0.05   -
    T=0.7 / T=1, top_p 0.9    -      -   0.16 / 0.08

hence ``MAX_NEW_TOKENS = 64``, and a training temperature of about 0.7: at T=1 only ~5% of
samples are right, so most groups would carry no signal.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from streamrl.domains.base import SINGLE_TURN, SandboxSpec, chat_prompt_ids
from streamrl.domains.fences import block_or_text
from streamrl.sandbox.base import ExecRequest, ExecResult, Limits

DATA_DIR = Path(__file__).parent / "data"
PROGRAM = "main.py"
# max_processes: bwrap itself needs a few processes of the sandbox uid, and ones of the
# previous run may still be exiting; at 8, about a third of the runs failed to start.
LIMITS = Limits(timeout_s=2.0, memory_mb=256, cpu_s=2, max_processes=32, max_file_mb=1,
                output_bytes=64 << 10)
MAX_NEW_TOKENS = 64  # calibrated, see benchmarks/calibrate_demo.py


class ArithItem(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    prompt: str  # the user message
    answer: str  # the exact expected stdout, stripped
    kind: str  # which task kind (domains.arith.tasks.KINDS)


def prompt_for(phrase: str) -> str:
    return f"Write a Python program that prints {phrase}."


def extract_program(text: str) -> str:
    """The first fenced code block, else the whole text (stripped)."""
    return block_or_text(text)


class Arith:
    name = "arith"
    item_type = ArithItem
    default_max_new_tokens = MAX_NEW_TOKENS
    episode = SINGLE_TURN
    sandbox = SandboxSpec(limits=LIMITS)

    def __init__(self, data_dir: Path = DATA_DIR, clean_run_credit: float = 0.0) -> None:
        if not 0.0 <= clean_run_credit < 1.0:
            raise ValueError("clean_run_credit must be in [0, 1)")
        self.data_dir = data_dir
        self.clean_run_credit = clean_run_credit
        self._cache: dict[str, list[ArithItem]] = {}

    def load_items(self, split: str) -> list[ArithItem]:
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', not {split!r}")
        if split not in self._cache:
            lines = (self.data_dir / f"{split}.jsonl").read_text().splitlines()
            self._cache[split] = [ArithItem(**json.loads(line)) for line in lines if line]
        return list(self._cache[split])

    def render_prompt(self, item: ArithItem, tokenizer: Any) -> list[int]:
        return chat_prompt_ids(tokenizer, item.prompt)

    def exec_request(self, item: ArithItem, completion_text: str) -> ExecRequest | None:
        program = extract_program(completion_text)
        if not program:
            return None
        return ExecRequest(argv=["python3", PROGRAM], files={PROGRAM: program.encode()},
                           limits=LIMITS)

    def score(self, item: ArithItem, completion_text: str, result: ExecResult | None) -> float:
        if result is None or result.timed_out:
            return 0.0
        stdout = result.stdout.decode("utf-8", errors="replace").strip()
        if stdout == item.answer:
            return 1.0
        return self.clean_run_credit if result.exit_code == 0 else 0.0
