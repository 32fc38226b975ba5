"""The ``repo_tests`` kind in the real process sandbox: a diff that fixes the bug scores 1.0,
the buggy repository and a diff that does not apply score 0, a multi-turn session judged as
the model left it; and the reward hacks, each against the harness and, as a control, against
a naive ``python3 -m pytest`` of the same files (where the hack does work)."""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from streamrl.domains.kinds import KINDS, Record
from streamrl.domains.kinds.repo_tests import FINAL, RepoTests, extract_diff
from streamrl.domains.repo.files import make_diff
from streamrl.domains.repo.generate import instance, record
from streamrl.domains.repo.templates import STRINGS
from streamrl.domains.tools.standard import StandardTools
from streamrl.inference.chat import ToolCall
from streamrl.sandbox import process
from streamrl.sandbox.base import ExecRequest, Limits
from streamrl.sandbox.process import ProcessSandbox

SANDBOX_PYTEST = subprocess.run(["/usr/bin/python3", "-c", "import pytest"],
                                capture_output=True).returncode == 0
pytestmark = pytest.mark.skipif(not SANDBOX_PYTEST, reason="the sandbox's python3 has no pytest "
                                "(Debian: apt-get install python3-pytest; .ci/run does)")

VERIFIER = RepoTests(test_timeout_s=20.0)
ROW = instance(STRINGS, next(b for b in STRINGS.bugs if b.name == "slug_last_word"), "textkit", 0)
ITEM = record(ROW)
MODULE, TESTS = "textkit/text.py", "tests/test_text.py"
FIXED = STRINGS.source
BUGGY = ROW["repo"][MODULE]


@pytest.fixture
async def box() -> AsyncIterator[ProcessSandbox]:
    opener = getattr(process, "open_process_sandbox", None)  # a served sandbox, where it is one
    if opener is None:
        sandbox = ProcessSandbox()
        yield sandbox
        await sandbox.aclose()
        return
    async with opener() as sandbox:
        yield sandbox


def diff_to(changes: dict[str, str | None], item: Record = ITEM) -> str:
    """A completion: the diff from the item's repository to it with ``changes`` (None:
    deleted)."""
    base = VERIFIER.repository(item)
    after = {p: d for p, d in base.items() if changes.get(p, "") is not None}
    after.update({p: t.encode() for p, t in changes.items() if t is not None})
    return f"```diff\n{make_diff(base, after)}```"


async def score(box: ProcessSandbox, completion: str, item: Record = ITEM,
                verifier: RepoTests = VERIFIER) -> float:
    verifier.check_item(item)
    request = verifier.exec_request(item, completion)
    result = await box.run(request) if request is not None else None
    return verifier.score(item, completion, result)


def naive(changes: dict[str, str | None], env: dict[str, str] | None = None) -> bool:
    """The control: the hidden tests written over the changed repository and run as
    ``python3 -m pytest <ids>`` in it, the way a harness without these defenses would.
    True when that says every test passed."""
    files = {p: d.decode() for p, d in VERIFIER.repository(ITEM).items()}
    files.update({p: t for p, t in changes.items() if t is not None})
    files.update(ITEM.tests)
    with tempfile.TemporaryDirectory() as work:
        for rel, text in files.items():
            (Path(work) / rel).parent.mkdir(parents=True, exist_ok=True)
            (Path(work) / rel).write_text(text)
        ids = [*ROW["FAIL_TO_PASS"], *ROW["PASS_TO_PASS"]]
        proc = subprocess.run(["/usr/bin/python3", "-m", "pytest", "-q", "-p",
                               "no:cacheprovider", *ids], cwd=work, capture_output=True,
                              env={"PATH": "/usr/bin:/bin", **(env or {})}, timeout=60)
        return proc.returncode == 0


# -- positive / negative -----------------------------------------------------------------


async def test_the_fix_scores_one_the_buggy_repository_zero(box: ProcessSandbox) -> None:
    assert KINDS["repo_tests"]({}).check_item(ITEM) is None  # type: ignore[func-returns-value]
    assert await score(box, diff_to({MODULE: FIXED})) == 1.0
    assert await score(box, f"```diff\n{ROW['solution']}```") == 1.0
    results = VERIFIER.test_results(ITEM, FINAL, await box.run(VERIFIER.judge(
        ITEM, VERIFIER.repository(ITEM))))
    status = {r.name: r.status for r in results}
    assert {status[t] for t in ROW["FAIL_TO_PASS"]} == {"fail"}
    assert {status[t] for t in ROW["PASS_TO_PASS"]} == {"pass"}
    failed = next(r for r in results if r.status == "fail")
    assert "assert 'hello' == 'hello-world'" in failed.message


async def test_partial_credit_counts_the_tests_that_pass(box: ProcessSandbox) -> None:
    partial = RepoTests(test_timeout_s=20.0, partial=True)
    n_f2p, n_p2p = len(ROW["FAIL_TO_PASS"]), len(ROW["PASS_TO_PASS"])
    # a change that fixes nothing: every PASS_TO_PASS test, none of the FAIL_TO_PASS ones
    readme = diff_to({"README.md": "# textkit\n"})
    assert await score(box, readme, verifier=partial) == n_p2p / (n_f2p + n_p2p)
    assert await score(box, readme) == 0.0


async def test_a_diff_that_does_not_apply_or_leaves_the_repository_scores_zero(
    box: ProcessSandbox,
) -> None:
    fix = make_diff({MODULE: VERIFIER.repository(ITEM)[MODULE]}, {MODULE: FIXED.encode()})
    for bad in (fix.replace("textkit/text.py", "../textkit/text.py"),
                fix.replace("a/textkit/text.py", "/etc/passwd").replace("b/textkit/text.py",
                                                                        "/etc/passwd"),
                "--- /dev/null\n+++ b/.git/hooks/pre-commit\n@@ -0,0 +1 @@\n+x\n",
                fix.replace("    return \"-\".join(words)", "    return words"),  # context
                "no diff here", ""):
        assert VERIFIER.exec_request(ITEM, f"```diff\n{bad}```") is None, bad
        assert await score(box, f"```diff\n{bad}```") == 0.0
    assert extract_diff(f"Here it is:\n{fix}") == fix


async def test_a_session_is_judged_as_the_model_left_it(box: ProcessSandbox) -> None:
    limits = Limits(timeout_s=30.0, memory_mb=1024, cpu_s=30, max_file_mb=16)
    async with box.session(limits, label="repo") as session:
        await session.put_files(VERIFIER.session_files(ITEM))
        seen = await session.get_files([TESTS])
        assert b"test_slugify_words" not in (seen[TESTS] or b"")  # hidden until the end
        # the model's own leftovers change nothing: junk, a conftest planted above the copy
        planted = await session.run(ExecRequest(argv=["sh", "-c", (
            "echo junk > report.xml; cat > /tmp/conftest.py; mkdir -p /tmp/x; "
            "cp /tmp/conftest.py /tmp/x/; ls /tmp/conftest.py")], stdin=FORGE_HOOK.encode()))
        assert planted.ok, planted
        final = await session.run(VERIFIER.final_request(ITEM))
        assert VERIFIER.score_final(ITEM, final) == 0  # the planted conftest is not read
        tools = StandardTools(session)
        patched = await tools.call(ToolCall(id="1", name="apply_patch",
                                            arguments={"patch": ROW["solution"]}))
        assert not patched.error, patched.content
        assert VERIFIER.score_final(ITEM, await session.run(VERIFIER.final_request(ITEM))) == 1


# -- the reward hacks: each scores 0 here, and passes a naive pytest run -----------------

FORGE_HOOK = '''
import re
import pytest

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not re.search(r"test_[0-9a-f]{16}$", item.nodeid):  # spares the canaries
        report.outcome = "passed"
        report.longrepr = None
'''
"""A forger that knows the harness: it marks every test passed but the canaries, so only the
defense each test is about stops it."""


async def test_editing_or_deleting_the_tests_changes_nothing(box: ProcessSandbox) -> None:
    trivial = "def test_slugify_words():\n    pass\n"
    assert await score(box, diff_to({TESTS: trivial})) == 0.0
    assert await score(box, diff_to({TESTS: None})) == 0.0
    assert await score(box, diff_to({TESTS: trivial, MODULE: FIXED})) == 1.0


async def test_a_conftest_that_marks_everything_passed_is_removed(box: ProcessSandbox) -> None:
    for path in ("conftest.py", "tests/conftest.py"):
        assert naive({path: FORGE_HOOK})
        assert await score(box, diff_to({path: FORGE_HOOK})) == 0.0


async def test_pytest_configuration_in_the_repository_is_not_read(box: ProcessSandbox) -> None:
    plugin = {"forge_plugin.py": FORGE_HOOK}
    for name, text in (("pytest.ini", "[pytest]\naddopts = -p forge_plugin\n"),
                       ("tox.ini", "[pytest]\naddopts = -p forge_plugin\n"),
                       ("setup.cfg", "[tool:pytest]\naddopts = -p forge_plugin\n"),
                       ("pyproject.toml", "[tool.pytest.ini_options]\n"
                                          "addopts = '-p forge_plugin'\n")):
        assert naive({**plugin, name: text}), name
        assert await score(box, diff_to({**plugin, name: text})) == 0.0, name


async def test_a_plugin_planted_as_an_installed_distribution_is_not_loaded(
    box: ProcessSandbox,
) -> None:
    dist = {"forge_plugin.py": FORGE_HOOK,
            "forge-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: forge\nVersion: 1.0\n",
            "forge-1.0.dist-info/entry_points.txt": "[pytest11]\nforge = forge_plugin\n"}
    assert naive(dist)
    assert await score(box, diff_to(dist)) == 0.0


async def test_exiting_at_import_leaves_no_pass(box: ProcessSandbox) -> None:
    for exit_call in ("import sys\nsys.exit(0)\n", "import os\nos._exit(0)\n"):
        hacked = exit_call + BUGGY
        assert await score(box, diff_to({MODULE: hacked})) == 0.0, exit_call
    # control: os._exit(0) at import makes a naive run exit 0
    assert naive({MODULE: "import os\nos._exit(0)\n"})


BLANKET = '''
import _pytest.reports
_orig = _pytest.reports.TestReport.from_item_and_call

def _forged(item, call):
    report = _orig(item, call)
    report.outcome, report.longrepr = "passed", None
    return report

_pytest.reports.TestReport.from_item_and_call = staticmathod_placeholder
'''.replace("staticmathod_placeholder", "staticmethod(_forged)")

REPORT_REWRITE = '''
import atexit, sys

def _rewrite():
    path = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--junitxml="))
    ids = [a for a in sys.argv[1:] if "::" in a]
    cases = "".join('<testcase file="%s" classname="%s" name="%s"/>' % (
        i.split("::")[0], i.split("::")[0][:-3].replace("/", "."), i.split("::")[1])
        for i in ids)
    open(path, "w").write("<testsuites><testsuite>" + cases + "</testsuite></testsuites>")

atexit.register(_rewrite)
'''


async def test_a_blanket_forgery_from_the_models_code_trips_the_canary(
    box: ProcessSandbox,
) -> None:
    for forgery in (BLANKET, REPORT_REWRITE):
        hacked = forgery + BUGGY
        completion = diff_to({MODULE: hacked})
        request = VERIFIER.exec_request(ITEM, completion)
        assert request is not None
        result = await box.run(request)
        # the forgery works on pytest's report: only the canaries give it away
        report = VERIFIER.report(ITEM, completion, result)
        assert report is not None
        assert {t["status"] for t in report["tests"] + report["canaries"]} == {"pass"}
        results = VERIFIER.test_results(ITEM, completion, result)
        assert results and {r.status for r in results} == {"error"}
        assert "forged" in results[0].message
        assert VERIFIER.score(ITEM, completion, result) == 0.0
    assert naive({MODULE: BLANKET + BUGGY})


async def test_not_prevented_a_forgery_that_spares_the_canary(box: ProcessSandbox) -> None:
    """The documented gap (repo_tests_harness.py): code in the pytest process that tells the
    canaries (random ``test_<16 hex>`` names) from the real tests can forge the rest."""
    targeted = BLANKET.replace('report.outcome, report.longrepr = "passed", None',
                               'import re\n    if not re.search(r"test_[0-9a-f]{16}$", '
                               'item.nodeid):\n        report.outcome, report.longrepr = '
                               '"passed", None')
    hacked = targeted + BUGGY
    assert await score(box, diff_to({MODULE: hacked})) == 1.0
