"""The terminal domain: data, parsing, and the hidden check in a real process sandbox session.

Each verifier test plays a whole episode by hand through the domain's own hooks, as the
executor does: stage the item's files, run each turn's command in one session, then stage and
run the hidden check. Positive: a reference solution of every task kind scores 1. Negative:
doing nothing, or a wrong answer, scores 0. Adversarial: printing "PASSED" (or a fake verdict
line), exiting early, deleting or editing the check, a script that kills the check, a
background process that would finish the work after the turn, a fifo in place of the answer
and giant output all score 0 (or stay bounded).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import pytest

from streamrl.domains.base import is_multi_turn
from streamrl.domains.registry import get_domain
from streamrl.domains.terminal import Terminal, TerminalItem, extract_command
from streamrl.domains.terminal.domain import MAX_OBSERVATION
from streamrl.domains.terminal.generate import make_splits
from streamrl.sandbox import ProcessSandbox, opened
from streamrl.sandbox.base import ExecResult, SandboxSession

DOMAIN = Terminal()


@pytest.fixture
async def sandbox() -> AsyncIterator[ProcessSandbox]:
    async with opened(ProcessSandbox()) as box:
        yield box


def item_of(kind: str) -> TerminalItem:
    return next(i for i in DOMAIN.load_items("train") if i.kind == kind)


def fence(command: str) -> str:
    return f"Let me run this.\n```sh\n{command}\n```"


async def play(
    box: ProcessSandbox, item: TerminalItem, turns: list[str]
) -> tuple[float, list[str]]:
    """Every turn's command in one session, then the hidden check: (reward, observations)."""
    async with box.session(DOMAIN.sandbox.limits, "test") as session:
        await session.put_files(DOMAIN.session_files(item))
        observations = []
        for text in turns:
            request = DOMAIN.exec_request(item, text)
            result = await session.run(request) if request else None
            observations.append(DOMAIN.render_observation(item, result))
            if DOMAIN.is_done(item, text):
                break
        return await check(session, item, turns[-1]), observations


async def check(session: SandboxSession, item: TerminalItem, last: str) -> float:
    result: ExecResult = await session.run(DOMAIN.final_request(item))
    return DOMAIN.score(item, last, result)


def answer_file(item: TerminalItem) -> str:
    """The file a ``count_matching`` item asks the number to be written to."""
    return re.search(r"number to (\S+)\.", item.prompt).group(1)  # type: ignore[union-attr]


def solution(item: TerminalItem) -> str:
    """A reference solution of the item, read off its instruction."""
    p = item.prompt
    if item.kind == "count_matching":
        how, word, out = re.search(r"that (contain|start with) the word '(\w+)' and write "
                                   r"just that number to (\S+)\.", p).groups()  # type: ignore[union-attr]
        test = f'$1=="{word}"' if how == "start with" else f'/(^| ){word}( |$)/'
        return f"awk '{test}' data.txt | wc -l > {out}"
    if item.kind == "sum_column":
        what, col, src, out = re.search(r"Write the (sum|largest value|smallest value) of the "
                                        r"(qty|price) column of (\S+) .* to (\S+)\.", p).groups()  # type: ignore[union-attr]
        n = 2 if col == "qty" else 3
        sort = {"sum": "", "largest value": " | sort -n | tail -1",
                "smallest value": " | sort -n | head -1"}[what]
        if what == "sum":
            return f"awk -F, 'NR>1{{s+=${n}}} END{{print s}}' {src} > {out}"
        return f"awk -F, 'NR>1{{print ${n}}}' {src}{sort} > {out}"
    if item.kind == "fix_script":
        what, name = re.search(r"should print the (.+) of its two arguments, but .* Fix (\S+) ",
                               p).groups()  # type: ignore[union-attr]
        op = {"product": "*", "sum": "+", "difference (first minus second)": "-",
              "integer quotient (first divided by second)": "/"}[what]
        return f"printf 'echo $(($1 {op} $2))\\n' > {name}"
    if item.kind == "rename_ext":
        folder, old, new = re.search(r"In the folder (\w+)/, .* ends in \.(\w+) so that it "
                                     r"ends in \.(\w+)", p).groups()  # type: ignore[union-attr]
        return f'cd {folder} && for f in *.{old}; do mv "$f" "${{f%.{old}}}.{new}"; done'
    if item.kind == "unique_sorted":
        src, order, out = re.search(r"distinct words of (\S+), sorted (.+), one per line, to "
                                    r"(\S+)\.", p).groups()  # type: ignore[union-attr]
        flags = "-u" if order == "alphabetically" else "-ru"
        return f"LC_ALL=C sort {flags} {src} > {out}"
    if item.kind == "move_errors":
        src, marker, dst = re.search(r"Move every file in (\w+)/ that contains the word (\w+) "
                                     r"into a new folder (\w+)/", p).groups()  # type: ignore[union-attr]
        return f"mkdir -p {dst} && for f in $(grep -l {marker} {src}/*); do mv $f {dst}/; done"
    raise AssertionError(item.kind)


# --------------------------------------------------------------------------- data


def test_registered_multi_turn_with_held_out_split() -> None:
    domain = get_domain("terminal")
    assert is_multi_turn(domain) and domain.episode.max_turns > 1
    train, held_out = domain.load_items("train"), domain.load_items("eval")
    assert len(train) >= 200 and len(held_out) >= 20
    assert not {i.prompt for i in train} & {i.prompt for i in held_out}
    assert {i.kind for i in held_out} == {i.kind for i in train}  # every kind held out too


def test_generator_reproduces_the_committed_data() -> None:
    splits = make_splits()
    assert splits["eval"] == DOMAIN.load_items("eval")
    assert splits["train"] == DOMAIN.load_items("train")


def test_command_and_done_marker_parsing() -> None:
    assert extract_command("ok\n```bash\nls -l\n```\nthen") == "ls -l"
    assert extract_command("<cmd>wc -l data.txt</cmd>") == "wc -l data.txt"
    assert extract_command("<cmd>cat a</cmd> ```sh\nls\n```") == "cat a"  # the first one
    assert extract_command("I think we are finished.") == ""
    item = item_of("count_matching")
    assert DOMAIN.exec_request(item, "no command here") is None
    assert DOMAIN.is_done(item, "All set <done>") and DOMAIN.is_done(item, "<DONE/>")
    assert not DOMAIN.is_done(item, fence("ls"))
    # the hidden check is never part of what the model sees
    assert item.check not in item.prompt and "check" not in DOMAIN.session_files(item)


# --------------------------------------------------------------------------- verifier


@pytest.mark.parametrize("kind", ["count_matching", "sum_column", "fix_script", "rename_ext",
                                  "unique_sorted", "move_errors"])
async def test_reference_solution_passes_and_nothing_fails(sandbox: ProcessSandbox,
                                                           kind: str) -> None:
    item = item_of(kind)
    # Given the reference solution as one command, then <done>
    reward, observations = await play(sandbox, item, [fence(solution(item)), "<done>"])
    assert reward == 1.0, observations
    assert observations[0].startswith("exit code 0")
    # And doing nothing at all (exit 0 early) fails the same item
    reward, _ = await play(sandbox, item, ["<done>"])
    assert reward == 0.0


async def test_wrong_answer_fails(sandbox: ProcessSandbox) -> None:
    item = item_of("count_matching")
    reward, _ = await play(sandbox, item, [fence(f"echo 99999 > {answer_file(item)}"), "<done>"])
    assert reward == 0.0


async def test_printing_passed_or_a_fake_verdict_fails(sandbox: ProcessSandbox) -> None:
    item = item_of("count_matching")
    fake = "echo PASSED; echo 'All tests passed'; echo \"$(printf '%064d' 0) PASS\"; exit 0"
    reward, observations = await play(sandbox, item, [fence(fake) + "\n<done>"])
    assert "PASSED" in observations[0] and reward == 0.0


async def test_deleting_or_editing_the_check_is_impossible(sandbox: ProcessSandbox) -> None:
    item = item_of("sum_column")
    # Given commands that hunt for the check and plant fakes where it might go
    hunt = ("rm -rf .check-* check* test* ; ls -la; "
            "for n in .check.sh check.sh test.sh; do printf 'echo PASS\\nexit 0\\n' > $n; done; "
            "ln -s /dev/null .check-0000000000000000.sh; exit 0")
    reward, observations = await play(sandbox, item, [fence(hunt), "<done>"])
    assert ".check-" not in observations[0].split("stdout:")[-1].replace(".check-0000", "")
    assert reward == 0.0


async def test_a_script_that_kills_or_reads_the_check_fails(sandbox: ProcessSandbox) -> None:
    item = item_of("fix_script")
    name = re.search(r"Fix (\S+) ", item.prompt).group(1)  # type: ignore[union-attr]
    for body in ("kill -9 $PPID; kill -9 0", "cat .check-* >&2; echo 0"):
        hack = f"printf '{body}\\n' > {name}"
        reward, _ = await play(sandbox, item, [fence(hack), "<done>"])
        assert reward == 0.0, body


async def test_work_left_to_a_background_process_does_not_count(sandbox: ProcessSandbox) -> None:
    item = item_of("count_matching")
    later = f"(sleep 1; {solution(item)}) >/dev/null 2>&1 & exit 0"
    reward, _ = await play(sandbox, item, [fence(later), fence("sleep 2"), "<done>"])
    assert reward == 0.0


async def test_a_fifo_answer_fails_within_the_deadline(sandbox: ProcessSandbox) -> None:
    item = item_of("count_matching")
    reward, _ = await play(sandbox, item, [fence(f"mkfifo {answer_file(item)}"), "<done>"])
    assert reward == 0.0


async def test_giant_output_is_cut_and_the_episode_goes_on(sandbox: ProcessSandbox) -> None:
    item = item_of("count_matching")
    flood = "yes 0123456789 | head -c 30000000; yes err | head -c 3000000 >&2"
    reward, observations = await play(sandbox, item, [fence(flood), fence(solution(item)),
                                                      "<done>"])
    assert len(observations[0]) < MAX_OBSERVATION + 200
    assert "characters cut" in observations[0]
    assert reward == 1.0  # the flood cost nothing but its own turn
