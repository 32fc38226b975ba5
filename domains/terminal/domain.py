"""The ``terminal`` domain: a multi-turn shell task in the style of terminal benchmarks.

An item is an instruction and the files staged in the work dir (``data.txt``, a buggy
``calc.sh``, a folder of files to rename...). Every turn the model writes ONE shell command,
in a fenced block (```sh / ```bash / bare ```) or between ``<cmd>`` and ``</cmd>``; it runs
with ``sh -c`` in the member's sandbox session (files persist between turns, processes do
not), and the observation fed back is the exit code and the end of stdout/stderr, at most
:data:`MAX_OBSERVATION` characters whatever the command printed. The model ends with
``<done>`` (a command in the same reply still runs first); the episode also ends at
``max_turns`` or when the token budget is spent.

Verification: a hidden check (a ``sh`` script per item) is staged into the session only when
the member has ended, under a fresh random name, after every command of the model has run
and been killed, so no command of the model ever sees it, can edit or delete it, or can
leave a process behind to tamper with it. The check removes itself as it starts, runs any
model-written script it needs with stdout captured and under ``timeout``, and prints one line
``<nonce> PASS`` and exits 0 only if the task is done. Reward 1.0 exactly when the check
exited 0 within its deadline and printed exactly that one line, else 0.0. So printing
"PASSED" (or anything) in a turn, exiting 0 early (``<done>`` at once), writing giant output
(capped, drained, counted; the observation is cut), or killing the check from a script it
runs (a non-zero exit) all score 0. A check that ``sh`` cannot parse or start is no reward:
:class:`~streamrl.domains.base.VerifierFailed` (issue 32 item 3). The nonce is an HMAC of
the item id under
``$STREAMRL_VERIFY_KEY`` (else the item's hidden salt), computed independently by the
executor that stages the check and the verifier that reads it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
from pathlib import Path
from typing import Any

import msgspec

from streamrl.domains.base import (
    EpisodePolicy,
    SandboxSpec,
    SplitFiles,
    VerifierFailed,
    chat_prompt_ids,
)
from streamrl.domains.fences import SHELL, fence
from streamrl.sandbox.base import ExecRequest, ExecResult, Limits

DATA_DIR = Path(__file__).parent / "data"
KEY_ENV = "STREAMRL_VERIFY_KEY"
MAX_NEW_TOKENS = 96
MAX_TURNS = 6
MAX_TOTAL_TOKENS = 2048
MAX_OBSERVATION = 1200  # characters fed back per turn
# output_bytes also bounds the work-dir snapshot that lets another replica take the next
# turn (actors/episodes.py); max_file_mb bounds each file the commands write.
LIMITS = Limits(timeout_s=5.0, memory_mb=256, cpu_s=5, max_processes=32, max_file_mb=4,
                output_bytes=1 << 20)

_FENCE = fence(SHELL)
_CMD = re.compile(r"<cmd>(.*?)(?:</cmd>|\Z)", re.DOTALL | re.IGNORECASE)
_DONE = re.compile(r"<done\s*/?>", re.IGNORECASE)


class TerminalItem(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    prompt: str  # the instruction shown to the model (with how to reply)
    kind: str
    files: dict[str, str]  # staged in the work dir before turn 1
    check: str  # hidden: the body of the check script (sh), exit 0 = solved
    salt: str  # hidden; the nonce key when no $STREAMRL_VERIFY_KEY


def extract_command(text: str) -> str:
    """The first fenced block or ``<cmd>`` element (whichever comes first), stripped."""
    found = [m for m in (_FENCE.search(text), _CMD.search(text)) if m is not None]
    if not found:
        return ""
    return min(found, key=lambda m: m.start()).group(1).strip()


def nonce(item: TerminalItem) -> str:
    key = (os.environ.get(KEY_ENV) or item.salt).encode()
    return hmac.new(key, b"terminal\0" + item.id.encode(), hashlib.sha256).hexdigest()


def check_script(item: TerminalItem) -> str:
    return (
        'rm -f "$0"\n'  # nothing the check runs can read or edit it
        "export PATH=/usr/bin:/bin LC_ALL=C\n"
        "verdict() {\n"
        f"{item.check}\n"
        "}\n"
        f"if verdict >/dev/null 2>&1 </dev/null; then echo '{nonce(item)} PASS'; exit 0; fi\n"
        "exit 1\n"
    )


class Terminal(SplitFiles):
    name = "terminal"
    item_type = TerminalItem
    default_max_new_tokens = MAX_NEW_TOKENS
    episode = EpisodePolicy(multi_turn=True, max_turns=MAX_TURNS,
                            max_total_tokens=MAX_TOTAL_TOKENS)
    sandbox = SandboxSpec(limits=LIMITS)

    def __init__(self, data_dir: Path = DATA_DIR) -> None:
        self.data_dir = data_dir

    def render_prompt(self, item: TerminalItem, tokenizer: Any) -> list[int]:
        return chat_prompt_ids(tokenizer, item.prompt)

    def session_files(self, item: TerminalItem) -> dict[str, bytes]:
        return {path: text.encode() for path, text in item.files.items()}

    def exec_request(self, item: TerminalItem, completion_text: str) -> ExecRequest | None:
        command = extract_command(completion_text)
        if not command:
            return None
        return ExecRequest(argv=["sh", "-c", command], limits=LIMITS)

    def render_observation(self, item: TerminalItem, result: ExecResult | None) -> str:
        if result is None:
            return ("No command found. Reply with exactly one shell command in a ```sh block, "
                    "or <done> when the task is complete.")
        status = "timed out" if result.timed_out else f"exit code {result.exit_code}"
        parts = [status]
        for name, data, dropped in (("stdout", result.stdout, result.stdout_dropped),
                                    ("stderr", result.stderr, result.stderr_dropped)):
            text = data.decode("utf-8", "replace")
            if text.strip() or dropped:
                parts.append(f"{name}:\n{_tail(text, MAX_OBSERVATION // 2, dropped)}")
        return "\n".join(parts)

    def is_done(self, item: TerminalItem, turn_text: str,
                result: ExecResult | None = None) -> bool:
        return bool(_DONE.search(turn_text))

    def final_request(self, item: TerminalItem) -> ExecRequest:
        name = f".check-{secrets.token_hex(8)}.sh"
        return ExecRequest(argv=["sh", name], files={name: check_script(item).encode()},
                           limits=LIMITS)

    def score(self, item: TerminalItem, completion_text: str, result: ExecResult | None) -> float:
        """1.0 exactly when the check passed (see the module), else 0.0.
        :class:`VerifierFailed` when the check itself could not run: ``sh`` could not parse
        it (exit 2 with a syntax error) or could not start (126/127). The check script ends
        with ``exit 0`` or ``exit 1`` and nothing the model left behind can change its
        parse; a signal from a script it runs is the model's doing (0)."""
        why = _check_failure(result)
        if why is not None:
            raise VerifierFailed(f"terminal: the check could not run: {why}"[:300])
        if result is None or result.timed_out or result.exit_code != 0 or result.stdout_dropped:
            return 0.0
        lines = result.stdout.decode("utf-8", "replace").splitlines()
        if len(lines) != 1:
            return 0.0
        head, _, verdict = lines[0].partition(" ")
        return 1.0 if hmac.compare_digest(head, nonce(item)) and verdict == "PASS" else 0.0


def _check_failure(result: ExecResult | None) -> str | None:
    """Why ``sh`` could not run the check script, else None."""
    if result is None or result.timed_out or result.oom_killed:
        return None
    stderr = result.stderr.decode("utf-8", "replace")
    lines = [line for line in stderr.splitlines() if line.strip()]
    last = lines[-1][:300] if lines else "no output"
    if result.exit_code == 2 and "syntax error" in stderr.lower():
        return last
    if result.exit_code in (126, 127):
        return f"exit {result.exit_code}: {last}"
    return None


def _tail(text: str, limit: int, dropped: int) -> str:
    if len(text) <= limit and not dropped:
        return text.rstrip("\n")
    cut = len(text) - limit + dropped if len(text) > limit else dropped
    return f"[... {cut} characters cut]\n" + text[-limit:].rstrip("\n")
