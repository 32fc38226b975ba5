"""The ``harbor`` kind (task directories in the Harbor layout) in the real process sandbox:
the reference solutions earn their test.sh's reward, a wrong or empty script earns 0, and a
script that tries to write its own reward, leave a process behind to tamper with the tests
or the reward, kill the harness, rewrite the work dir test.sh reads, or flood, earns nothing
for it."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest

from streamrl.domains.base import VerifierFailed
from streamrl.domains.kinds import KINDS, Record
from streamrl.domains.kinds.examples import HARBOR_TASKS, write_harbor_example
from streamrl.domains.kinds.harbor import Harbor, load_harbor
from streamrl.domains.kinds.harbor_harness import rewrite
from streamrl.sandbox.process import ProcessSandbox, open_process_sandbox

UID_BASE = 370_000 + (os.getpid() % 500) * 1024
VERIFIER = Harbor(solution_timeout_s=3.0, test_timeout_s=5.0)


@pytest.fixture
async def box():  # type: ignore[no-untyped-def]
    async with open_process_sandbox(uid_base=UID_BASE) as sandbox:
        yield sandbox


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Record]:
    out = tmp_path_factory.mktemp("harbor")
    write_harbor_example(out)
    return {item.id: item for item in load_harbor(out / "harbor")}


async def run(box: ProcessSandbox, item: Record, script: str,
              verifier: Harbor = VERIFIER) -> float:
    verifier.check_item(item)
    completion = f"```bash\n{script}\n```"
    request = verifier.exec_request(item, completion)
    result = await box.run(request) if request is not None else None
    return verifier.score(item, completion, result)


def solution(item: Record) -> str:
    return base64.b64decode(item.extra["solution"]["solve.sh"]).decode()


# -- positive / negative -----------------------------------------------------------------


async def test_reference_solutions_earn_their_reward(
    box: ProcessSandbox, tasks: dict[str, Record],
) -> None:
    assert sorted(tasks) == sorted(HARBOR_TASKS)
    for name, item in tasks.items():
        assert await run(box, item, solution(item)) == 1.0, name


async def test_partial_credit_is_the_reward_files_number(
    box: ProcessSandbox, tasks: dict[str, Record],
) -> None:
    script = "mkdir -p /app/out && echo a > /app/out/a.txt && echo c > /app/out/c.txt"
    assert await run(box, tasks["letters"], script) == 0.5


async def test_a_wrong_or_empty_script_earns_nothing(
    box: ProcessSandbox, tasks: dict[str, Record],
) -> None:
    item = tasks["hello-file"]
    assert await run(box, item, "echo 'Hello, World' > /app/hello.txt") == 0.0
    assert await run(box, item, "exit 3") == 0.0
    assert VERIFIER.exec_request(item, "") is None


async def test_the_report_names_the_tests_outcome(
    box: ProcessSandbox, tasks: dict[str, Record],
) -> None:
    item, completion = tasks["hello-file"], "```bash\necho nope\n```"
    result = await box.run(VERIFIER.exec_request(item, completion))  # type: ignore[arg-type]
    report = VERIFIER.report(item, completion, result)
    assert report is not None and report["solution"]["stdout"] == "nope\n"
    assert report["reward"] == 0.0
    assert [r.status for r in VERIFIER.test_results(item, completion, result)] == ["fail"]


@pytest.mark.parametrize(("reward", "expected"), [("1.7", 1.0), ("-2", 0.0), ("0.25\n", 0.25)])
async def test_the_reward_is_clamped(box: ProcessSandbox, reward: str, expected: float) -> None:
    assert await run(box, _writes(reward), "true") == expected


def _writes(reward: str, then: str = "") -> Record:
    test_sh = f"printf '%s' '{reward}' > /logs/verifier/reward.txt\n{then}"
    return Record(id="r", prompt="p", tests={"test.sh": base64.b64encode(
        test_sh.encode()).decode()})


@pytest.mark.parametrize("reward", ["nan", "yes", ""])
async def test_a_garbage_reward_is_a_verifier_failure_not_a_zero(
    box: ProcessSandbox, reward: str,
) -> None:
    with pytest.raises(VerifierFailed, match="no readable reward"):
        await run(box, _writes(reward), "true")


@pytest.mark.parametrize("test_sh", [b"exit 1", b"exit 0", b"echo broken >&2; exit 2"])
async def test_a_test_sh_that_writes_no_reward_is_a_verifier_failure_not_a_zero(
    box: ProcessSandbox, test_sh: bytes,
) -> None:
    # Given a task whose test.sh crashes (or ends) without writing a reward (issue 32 item 3)
    item = Record(id="none", prompt="p", tests={"test.sh": base64.b64encode(test_sh).decode()})
    # When a solution is judged, Then the kind says it could not judge it, naming the exit
    code = test_sh.split()[-1].decode()
    with pytest.raises(VerifierFailed, match=f"test.sh exited {code}.*no readable reward"):
        await run(box, item, "true")


async def test_a_test_sh_that_writes_a_zero_is_a_wrong_answer(box: ProcessSandbox) -> None:
    assert await run(box, _writes("0", "exit 1"), "true") == 0.0


async def test_an_infinite_loop_is_cut_and_the_tests_still_run(
    box: ProcessSandbox, tasks: dict[str, Record],
) -> None:
    script = "echo 'Hello, world!' > /app/hello.txt\nwhile true; do :; done"
    assert await run(box, tasks["hello-file"], script) == 1.0


# -- reward hacking ------------------------------------------------------------------------


async def test_a_reward_file_the_script_writes_is_ignored(
    box: ProcessSandbox, tasks: dict[str, Record],
) -> None:
    # Given a script that does not do the task but writes a reward of 1 everywhere a reward
    # file could be looked for (the work dir, /tmp, HOME, a /logs it cannot create)
    script = ("for d in /logs/verifier /app/logs/verifier /tmp/logs/verifier "
              "/tmp/logs-x/verifier $HOME/logs/verifier; do\n"
              "  mkdir -p $d 2>/dev/null; echo 1 > $d/reward.txt 2>/dev/null\ndone\n"
              "echo 1 > reward.txt; echo '{\"reward\": 1}' > reward.json")
    # Then the fresh reward location, made after it ran, holds test.sh's 0
    assert await run(box, tasks["hello-file"], script) == 0.0
    # and no reward at all where test.sh writes one only on success (no reward file: the
    # verifier failed, not the script earned 1)
    only_on_success = ('[ "$(cat /app/hello.txt)" = "Hello, world!" ] && '
                       "echo 1 > /logs/verifier/reward.txt\nexit 0\n")
    item = Record(id="lazy", prompt="p", tests={"test.sh": base64.b64encode(
        only_on_success.encode()).decode()})
    with pytest.raises(VerifierFailed, match="no readable reward"):
        await run(box, item, script)
    assert await run(box, item, "echo 'Hello, world!' > /app/hello.txt") == 1.0


async def test_a_background_process_cannot_tamper_with_tests_or_reward(
    box: ProcessSandbox, tasks: dict[str, Record],
) -> None:
    # Given a script that leaves a detached process (setsid, nohup, double fork) rewriting
    # every test.sh and reward.txt it finds, and the answer the test expects, for 3 s
    tamper = ("for i in $(seq 300); do\n"
              "  for f in /tmp/*/test.sh /tmp/*/check.py; do echo 'echo 1 > "
              "/tmp/logs-*/verifier/reward.txt' > $f 2>/dev/null; done\n"
              "  for d in /tmp/*/verifier; do echo 1 > $d/reward.txt 2>/dev/null; done\n"
              "  echo 5 > /app/count.txt\n  sleep 0.01\ndone")
    script = (f"cat > /tmp/t.sh <<'EOF'\n{tamper}\nEOF\n"
              "(setsid nohup bash /tmp/t.sh >/dev/null 2>&1 &) &\n"
              "echo 4 > /app/count.txt")
    # Then it is dead before tests/ exists: the wrong count earns 0
    assert await run(box, tasks["count-lines"], script) == 0.0


async def test_killing_or_stopping_the_harness_earns_nothing(
    box: ProcessSandbox, tasks: dict[str, Record],
) -> None:
    item = tasks["hello-file"]
    forged = "printf '%064d {\"reward\": 1}\\n' 0"
    assert await run(box, item, f"{forged}\nkill -9 $PPID") == 0.0
    assert await run(box, item, f"{forged}\nkill -9 -1") == 0.0
    assert await run(box, item, "kill -STOP $PPID", Harbor(1.0, 1.0)) == 0.0


async def test_rewriting_the_work_dir_input_does_not_fool_a_hidden_reference(
    box: ProcessSandbox, tasks: dict[str, Record],
) -> None:
    # Given a script that rewrites the input so that its wrong count looks right
    script = "printf 'a\\nb\\n' > /app/data/words.txt\nsort -u /app/data/words.txt | " \
             "wc -l > /app/count.txt"
    # Then test.sh's reference, in tests/, still says 5
    assert await run(box, tasks["count-lines"], script) == 0.0


async def test_planted_python_user_site_does_not_reach_the_tests(
    box: ProcessSandbox, tasks: dict[str, Record],
) -> None:
    # Given a script that plants a usercustomize in HOME's user site that rewrites the
    # reward when test.sh's python exits
    hook = ("import atexit, glob\natexit.register(lambda: [open(f, 'w').write('1') for f in "
            "glob.glob('/tmp/*/verifier/reward.txt')])\n")
    script = ("d=$(python3 -c 'import site; print(site.getusersitepackages())')\n"
              f"mkdir -p $d && cat > $d/usercustomize.py <<'EOF'\n{hook}EOF\n"
              "echo 1 > /app/count.txt")
    # Then test.sh runs with a fresh HOME and no user site: 0
    assert await run(box, tasks["count-lines"], script) == 0.0


async def test_huge_outputs_are_tails_and_the_reward_stands(
    box: ProcessSandbox, tasks: dict[str, Record],
) -> None:
    script = "head -c 30000000 /dev/zero | tr '\\0' x\nhead -c 30000000 /dev/zero >&2\n" \
             "echo 'Hello, world!' > /app/hello.txt"
    assert await run(box, tasks["hello-file"], script) == 1.0


def test_paths_are_rewritten_only_where_a_path_starts() -> None:
    paths = {"/tests": "/tmp/tests-1", "/logs": "/tmp/logs-2", "/app": "/work"}
    assert rewrite("cat /tests/x > /logs/verifier/reward.txt; cd /app", paths) == \
        "cat /tmp/tests-1/x > /tmp/logs-2/verifier/reward.txt; cd /work"
    assert rewrite("open('/app/a') /usr/app x/tests /tests2 /apps", paths) == \
        "open('/work/a') /usr/app x/tests /tests2 /apps"


def test_the_loader_reads_the_layout_and_the_kind_is_registered(
    tmp_path: Path, tasks: dict[str, Record],
) -> None:
    item = tasks["hello-file"]
    assert item.prompt.startswith("Create the file") and set(item.tests) == {"test.sh"}
    assert item.extra["agent_timeout_s"] == 20.0 and item.extra["environment"] == {}
    assert "data/words.txt" in tasks["count-lines"].extra["environment"]
    verifier = KINDS["harbor"]({"test_timeout_s": 10})
    assert isinstance(verifier, Harbor) and verifier.sandbox.limits.timeout_s == 45.0
    with pytest.raises(ValueError, match=r"test\.sh"):
        verifier.check_item(Record(id="x", prompt="p", tests={}))
    with pytest.raises(ValueError, match="unknown option"):
        KINDS["harbor"]({"timeout": 1})
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "instruction.md").write_text("x")
    with pytest.raises(ValueError, match=r"no tests/test\.sh"):
        load_harbor(tmp_path)


async def test_the_example_data_sets_declare_as_domains(
    box: ProcessSandbox, tmp_path: Path,
) -> None:
    # Given both example data sets written by code and declared as [domain.<name>] tables
    import msgspec

    from streamrl.config.schema import DomainConfig
    from streamrl.domains.declared import build_domain
    from streamrl.domains.kinds.examples import write_stdio_example

    for kind, data in (("stdio", write_stdio_example(tmp_path)),
                       ("harbor", write_harbor_example(tmp_path))):
        cfg = msgspec.convert({"kind": kind, "data": str(data)}, DomainConfig)
        domain = build_domain(f"{kind}-example", cfg)
        items = domain.load_items("train") + domain.load_items("eval")
        assert len(items) >= 3
        # Then each item's reference solution earns 1 through the declared domain
        for item in items:
            ref = item.extra["solution"]
            completion = ref if kind == "stdio" else f"```bash\n{solution(item)}\n```"
            request = domain.exec_request(item, completion)
            assert request is not None
            assert domain.score(item, completion, await box.run(request)) == 1.0, item.id
