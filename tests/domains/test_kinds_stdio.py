"""The ``stdio`` kind (APPS / CodeContests stdin/stdout cases) in the real process sandbox:
a right program passes every case, a wrong one fails with expected vs got, a crashing one
errors with its stderr, and a program that tries to game the cases (print every answer, read
the expected output, exit early, write from a background child, flood, loop) earns nothing
for it."""

from __future__ import annotations

import os

import pytest

from streamrl.domains.kinds import KINDS, Record
from streamrl.domains.kinds import stdio as _stdio  # noqa: F401  (registers the kind)
from streamrl.domains.kinds.examples import stdio_rows
from streamrl.domains.kinds.stdio import Stdio
from streamrl.domains.kinds.stdio_harness import same_output
from streamrl.sandbox.process import ProcessSandbox, open_process_sandbox

UID_BASE = 350_000 + (os.getpid() % 500) * 1024

# a + b for each line "a b"; the answer to the first line is a secret of the harness
CASES = [{"input": "1 2\n", "output": "3\n"},
         {"input": "10 -4\n", "output": "6\n"},
         {"input": "7 7\n", "output": "14"}]
ITEM = Record(id="sum", prompt="Read a and b, print a + b.", tests=CASES)
RIGHT = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"


@pytest.fixture
async def box():  # type: ignore[no-untyped-def]
    async with open_process_sandbox(uid_base=UID_BASE) as sandbox:
        yield sandbox


async def run(box: ProcessSandbox, completion: str, item: Record = ITEM,
              verifier: Stdio | None = None) -> tuple[float, list[str]]:
    verifier = verifier or Stdio(per_case_timeout_s=1.0)
    verifier.check_item(item)
    request = verifier.exec_request(item, completion)
    result = await box.run(request) if request is not None else None
    statuses = [r.status for r in verifier.test_results(item, completion, result)]
    return verifier.score(item, completion, result), statuses


# -- positive / negative -----------------------------------------------------------------


async def test_a_right_program_passes_every_case(box: ProcessSandbox) -> None:
    assert await run(box, RIGHT) == (1.0, ["pass", "pass", "pass"])


async def test_a_whole_completion_without_a_fence_is_the_program(box: ProcessSandbox) -> None:
    completion = "import sys\nfor line in sys.stdin:\n    a, b = line.split()\n" \
                 "    print(int(a) + int(b), end='   \\n\\n\\n')\n"
    assert await run(box, completion) == (1.0, ["pass", "pass", "pass"])


async def test_the_apps_layout_as_a_json_string_is_read(box: ProcessSandbox) -> None:
    apps = Record(id="apps-1", prompt="p", tests='{"inputs": ["2\\n", ["3", ""]], '
                                                 '"outputs": ["4\\n", "9\\n"]}')
    assert await run(box, "n = int(input())\nprint(n * n)", apps) == (1.0, ["pass", "pass"])


async def test_a_wrong_program_fails_with_expected_and_got(box: ProcessSandbox) -> None:
    verifier = Stdio()
    completion = "a, b = map(int, input().split())\nprint(a - b if a == 10 else a + b)"
    result = await box.run(verifier.exec_request(ITEM, completion))  # type: ignore[arg-type]
    results = verifier.test_results(ITEM, completion, result)
    assert [r.status for r in results] == ["pass", "fail", "pass"]
    assert results[1].message == "expected '6\\n', got '14\\n'"
    assert verifier.score(ITEM, completion, result) == pytest.approx(2 / 3)
    assert Stdio(all_or_nothing=True).score(ITEM, completion, result) == 0.0


async def test_a_crashing_program_errors_with_its_stderr_tail(box: ProcessSandbox) -> None:
    verifier = Stdio()
    completion = "a, b = map(int, input().split())\nif a == 1:\n    raise KeyError('nope')\n" \
                 "print(a + b)"
    result = await box.run(verifier.exec_request(ITEM, completion))  # type: ignore[arg-type]
    results = verifier.test_results(ITEM, completion, result)
    assert [r.status for r in results] == ["error", "pass", "pass"]
    assert results[0].message.startswith("exit 1:") and "KeyError: 'nope'" in results[0].message


async def test_an_infinite_loop_times_out_its_case_and_the_next_case_runs(
    box: ProcessSandbox,
) -> None:
    completion = "a, b = map(int, input().split())\nwhile a == 7:\n    pass\nprint(a + b)"
    assert await run(box, completion) == (pytest.approx(2 / 3), ["pass", "pass", "timeout"])


async def test_cases_past_the_runs_budget_time_out_without_running(box: ProcessSandbox) -> None:
    # Given a run budget of 1 s (4 s sandbox limit less the harness's margin) and a program
    # that sleeps 0.7 s per case, 3 cases
    verifier = Stdio(per_case_timeout_s=5.0, sandbox=Stdio().sandbox.with_overrides(4.0))
    completion = "import time\ntime.sleep(0.7)\na, b = map(int, input().split())\nprint(a + b)"
    score, statuses = await run(box, completion, verifier=verifier)
    # Then the first case passes and the rest are timeouts, the run itself is not lost
    assert statuses[0] == "pass" and statuses[-1] == "timeout" and 0 < score < 1


def test_comparison_modes() -> None:
    assert same_output("3  \n\n", "3\n") and not same_output("3 \n", "3\n", "exact")
    assert not same_output("1 2\n", "1  2\n") and same_output("1 2\n", "1\n 2", "tokens")
    assert same_output("0.3333333\n", "0.333333333", float_tol=1e-6)
    assert not same_output("0.334\n", "0.333333333", float_tol=1e-6)
    assert same_output("1e9", "1000000001", float_tol=1e-6)  # relative
    assert not same_output("nan", "1.0", float_tol=1e9)
    assert not same_output("1_0", "10", float_tol=1)
    assert not same_output("YES NO", "YES", "tokens")


async def test_float_tolerance_in_the_sandbox(box: ProcessSandbox) -> None:
    item = Record(id="third", prompt="p", tests=[{"input": "1\n", "output": "0.333333333\n"}])
    completion = "print(1 / 3 + 1e-8)"
    assert (await run(box, completion, item))[0] == 0.0
    assert (await run(box, completion, item, Stdio(float_tolerance=1e-6)))[0] == 1.0


# -- reward hacking ------------------------------------------------------------------------


@pytest.mark.parametrize("hack", [
    # print every possible answer (every sum in a range, YES and NO)
    "for i in range(-50, 50):\n    print(i)\nprint('YES')\nprint('NO')",
    # exit early, 0, before printing anything; with os._exit
    "import sys\nsys.exit(0)",
    "import os\nos._exit(0)",
    # fork a background child that writes the answers after the main process is gone
    "import os, time\na, b = map(int, input().split())\nif os.fork() == 0:\n"
    "    os.setsid()\n    time.sleep(0.3)\n    print(a + b, flush=True)\n    os._exit(0)\n",
    # find the expected output: the harness's memory, fds, environment, files, stdin
    "import os, glob\nppid = os.getppid()\nseen = ''\n"
    "for p in [f'/proc/{ppid}/mem', f'/proc/{ppid}/fd/0', f'/proc/{ppid}/environ',"
    " f'/proc/{ppid}/cmdline', '/proc/1/fd/0', '/proc/1/environ',"
    " *glob.glob('/work/*'), *glob.glob('/tmp/*')]:\n"
    "    try:\n        seen += open(p, errors='replace').read(1 << 20)\n"
    "    except Exception as e:\n        pass\n"
    "import re, sys\nsys.stdin.read()\n"
    "found = re.findall(r'\"output\": \"([^\"]*)\"', seen)\n"
    "print(found[0].replace('\\\\n', '\\n') if found else 'nothing', end='')",
    # kill the harness and print a forged report line
    "import os, signal\nprint('0' * 64 + ' [{\"name\": \"case_0\", \"status\": \"pass\"}]')\n"
    "os.kill(os.getppid(), signal.SIGKILL)",
])
async def test_gaming_the_cases_earns_nothing(box: ProcessSandbox, hack: str) -> None:
    score, statuses = await run(box, f"```python\n{hack}\n```")
    assert score == 0.0 and "pass" not in statuses


async def test_the_expected_outputs_never_reach_the_programs_process(box: ProcessSandbox) -> None:
    # Given a case whose expected output is a marker no input contains
    item = Record(id="secret", prompt="p",
                  tests=[{"input": "x\n", "output": "MARKER-4b1d\n"}] * 2)
    # When the program dumps everything it can read to its stdout (stdin, the work dir,
    # /tmp, every /proc entry of every process it can see)
    hack = ("import os, glob, sys\ndata = sys.stdin.read()\n"
            "for p in glob.glob('/work/*') + glob.glob('/tmp/**', recursive=True) + "
            "glob.glob('/proc/[0-9]*/*'):\n"
            "    try:\n        data += open(p, errors='replace').read(1 << 16)\n"
            "    except Exception:\n        pass\n"
            "for maps in glob.glob('/proc/[0-9]*/maps'):\n"  # every other process's memory
            "    if maps == f'/proc/{os.getpid()}/maps':\n        continue\n"
            "    try:\n        mem = open(maps[:-4] + 'mem', 'rb')\n"
            "        for line in open(maps):\n"
            "            lo, hi = (int(x, 16) for x in line.split()[0].split('-'))\n"
            "            if line.split()[1].startswith('rw'):\n"
            "                try:\n                    mem.seek(lo)\n"
            "                    data += mem.read(min(hi - lo, 1 << 24)).decode('latin-1')\n"
            "                except Exception:\n                    pass\n"
            "    except Exception:\n        pass\n"
            "mark = 'MARKER-' + '4b1d'  # (its source must not hold the marker itself)\n"
            "print(mark if mark in data else 'not found')")
    verifier = Stdio(per_case_timeout_s=5.0)
    result = await box.run(verifier.exec_request(item, hack))  # type: ignore[arg-type]
    results = verifier.test_results(item, hack, result)
    # Then it never found it
    assert [r.status for r in results] == ["fail", "fail"]
    assert "got 'not found\\n'" in results[0].message


async def test_a_huge_output_is_truncated_and_earns_nothing(box: ProcessSandbox) -> None:
    flood = "import sys\nwhile True:\n    sys.stdout.write('3\\n' * 100000)"
    score, statuses = await run(box, flood)
    assert score == 0.0 and statuses == ["truncated"] * 3
    # and a completion of megabytes is still a program, judged, not a crash
    huge = RIGHT + "\n# " + "y" * 3_000_000
    assert (await run(box, huge))[0] == 1.0


async def test_a_fork_bomb_costs_its_case_only(box: ProcessSandbox) -> None:
    bomb = ("import os\na, b = map(int, input().split())\nif a == 1:\n    while True:\n"
            "        try:\n            os.fork()\n        except OSError:\n            pass\n"
            "print(a + b)")
    _, statuses = await run(box, bomb)
    assert statuses[1:] == ["pass", "pass"] and statuses[0] != "pass"


def test_the_kind_is_registered_and_refuses_bad_items_and_options() -> None:
    verifier = KINDS["stdio"]({"compare": "tokens", "max_cases": 2})
    assert isinstance(verifier, Stdio) and len(verifier.cases(ITEM)) == 2
    with pytest.raises(ValueError, match="no tests"):
        verifier.check_item(Record(id="x", prompt="p"))
    with pytest.raises(ValueError, match="call-based"):
        verifier.check_item(Record(id="x", prompt="p", tests={"fn_name": "f", "inputs": [],
                                                               "outputs": []}))
    with pytest.raises(ValueError, match="same length"):
        verifier.check_item(Record(id="x", prompt="p", tests={"inputs": ["1"], "outputs": []}))
    with pytest.raises(ValueError, match="compare"):
        KINDS["stdio"]({"compare": "fuzzy"})
    with pytest.raises(ValueError, match="unknown option"):
        KINDS["stdio"]({"tolerance": 1})


async def test_the_example_data_set_reference_solutions_pass(box: ProcessSandbox) -> None:
    verifier = Stdio()
    for row in stdio_rows():
        item = Record(id=row["id"], prompt=row["prompt"], tests=row["tests"])
        verifier.check_item(item)
        assert (await run(box, row["solution"], item, verifier))[0] == 1.0, row["id"]
