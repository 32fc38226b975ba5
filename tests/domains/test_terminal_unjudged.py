"""The terminal domain tells a hidden check that cannot run from an unsolved task (issue 32
item 3): a check script the shell cannot parse is
:class:`~streamrl.domains.base.VerifierFailed`, never a reward of 0; what the model's
commands did (an unsolved task, a work dir it made unreadable, a script that kills the
check) still scores 0. Real process sandbox."""

from __future__ import annotations

import msgspec
import pytest

from streamrl.domains.base import VerifierFailed
from streamrl.domains.terminal import TerminalItem
from streamrl.sandbox import ProcessSandbox
from tests.domains.test_terminal import DOMAIN, fence, item_of, play, sandbox, solution

__all__ = ["sandbox"]  # the fixture, shared with test_terminal


def with_check(item: TerminalItem, body: str) -> TerminalItem:
    return msgspec.structs.replace(item, check=body)


async def test_a_check_the_shell_cannot_parse_is_a_verifier_failure(
    sandbox: ProcessSandbox,
) -> None:
    item = item_of("count_matching")
    assert (await play(sandbox, item, [fence(solution(item)) + "\n<done>"]))[0] == 1.0
    # Given a solved task whose hidden check has a syntax error, When it is scored, Then the
    # domain says it could not judge it, with the shell's error
    with pytest.raises(VerifierFailed, match=r"(?i)the check could not run.*syntax error"):
        await play(sandbox, with_check(item, "[ -f x ] && ("), [fence(solution(item))
                                                                 + "\n<done>"])


@pytest.mark.parametrize("command", ["echo nothing", "chmod 000 .", "chmod 000 . ; cd /"],
                         ids=["unsolved", "unreadable-workdir", "unreadable-then-cd"])
async def test_what_the_commands_did_still_scores_zero(sandbox: ProcessSandbox, command: str
                                                       ) -> None:
    item = item_of("count_matching")
    assert (await play(sandbox, item, [fence(command) + "\n<done>"]))[0] == 0.0
    assert DOMAIN.score(item, "", None) == 0.0
