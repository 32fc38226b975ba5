"""The cad domain against the real process sandbox (bwrap here): correct shapes score 1,
wrong ones partially, and every reward hack scores what the honest shape behind it is
worth (or 0). Each script really runs manifold3d/trimesh from the CAD runtime, installed
for the sandbox's python3 on first use (``python -m streamrl.domains.cad.runtime``)."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator

import pytest
import trio

from streamrl.domains.cad import CONSTRAINTS, Cad, CadItem, constraints, read_verdict
from streamrl.domains.cad import generate as gen
from streamrl.domains.cad.domain import SCRIPT_TIMEOUT_S, nonce, program
from streamrl.domains.cad.runtime import install
from streamrl.domains.registry import get_domain
from streamrl.sandbox.base import ExecResult
from streamrl.sandbox.process import ProcessSandbox, open_process_sandbox

HEAD = "from manifold3d import Manifold\nimport numpy as np\n"
SAVE = ('mesh = shape.to_mesh()\n'
        'np.savez("out.npz", vertices=mesh.vert_properties[:, :3], faces=mesh.tri_verts)\n')


@pytest.fixture(scope="module")
def cad() -> Cad:
    install()  # idempotent; pip from the package index on a fresh machine
    return Cad(script_timeout_s=6.0)


@pytest.fixture
async def box() -> AsyncIterator[ProcessSandbox]:
    async with open_process_sandbox() as sandbox:
        yield sandbox


def fenced(source: str) -> str:
    return f"Here is the script:\n```python\n{source}```\n"


def item(kind: str = "box", volume: float = 6000.0, extents: tuple[float, ...] = (10, 20, 30),
         genus: int = 0, bodies: int = 1) -> CadItem:
    return CadItem(id=f"cad-test-{kind}", prompt="build it", kind=kind, volume=volume,
                   extents=list(extents), genus=genus, bodies=bodies, reference="",
                   salt="0123456789abcdef")


BOX = item()
BOX_SCRIPT = HEAD + "shape = Manifold.cube([10, 20, 30])\n" + SAVE


async def run(cad: Cad, box: ProcessSandbox, it: CadItem, text: str) -> tuple[float, ExecResult]:
    request = cad.exec_request(it, text)
    assert request is not None
    result = await box.run(request)
    return cad.score(it, text, result), result


def test_registered_through_entry_point() -> None:
    domain = get_domain("cad")
    assert domain.name == "cad" and domain.sandbox.backend == "process"
    train, held_out = domain.load_items("train"), domain.load_items("eval")
    assert len(train) == 300 and len(held_out) == 32
    assert not {i.prompt for i in train} & {i.prompt for i in held_out}


def test_generated_data_is_reproducible_and_consistent() -> None:
    # the files are what the generator writes, and every family's closed-form volume is what
    # manifold3d computes for the reference shape (within the domain's tolerance)
    from manifold3d import Manifold  # noqa: F401  (the reference scripts use it)

    splits = gen.make_splits()
    domain = Cad()
    assert [i.id for i in splits["eval"]] == [i.id for i in domain.load_items("eval")]
    assert splits["eval"] == domain.load_items("eval")
    for it in splits["eval"] + splits["train"][:60]:
        namespace: dict[str, object] = {}
        exec(it.reference.replace(SAVE, ""), namespace)
        shape = namespace["shape"]
        assert math.isclose(shape.volume(), it.volume, rel_tol=0.05), it.kind  # type: ignore[attr-defined]
        parts = shape.decompose()  # type: ignore[attr-defined]
        assert sum(p.genus() for p in parts) == it.genus, it.kind
        assert len(parts) == it.bodies, it.kind


async def test_every_reference_shape_scores_full(cad: Cad, box: ProcessSandbox) -> None:
    # the domain's own script timeout, not the module's 6 s: 8 scripts start at once, each
    # importing numpy and manifold3d, and on a loaded CI machine all 8 once scored 0
    cad = Cad(script_timeout_s=SCRIPT_TIMEOUT_S)
    one_per_kind = {it.kind: it for it in cad.load_items("eval")}
    assert len(one_per_kind) == 8
    scores: dict[str, float] = {}

    async def one(it: CadItem) -> None:
        scores[it.kind], _ = await run(cad, box, it, fenced(it.reference))

    async with trio.open_nursery() as nursery:
        for it in one_per_kind.values():
            nursery.start_soon(one, it)
    assert scores == {kind: 1.0 for kind in one_per_kind}


async def test_wrong_size_meets_only_the_topology_constraints(
    cad: Cad, box: ProcessSandbox
) -> None:
    text = fenced(HEAD + "shape = Manifold.cube([10, 20, 10])\n" + SAVE)
    score, result = await run(cad, box, BOX, text)
    verdict = read_verdict(BOX, text, result)
    assert verdict is not None
    assert constraints(BOX, verdict) == {"watertight": True, "volume": False,
                                         "extents": False, "genus": True, "bodies": True}
    assert score == pytest.approx(3 / len(CONSTRAINTS))


async def test_missing_hole_fails_genus_and_volume(cad: Cad, box: ProcessSandbox) -> None:
    plate = item("plate_hole", volume=20 * 20 * 4 - math.pi * 9 * 4, extents=(20, 20, 4),
                 genus=1)
    text = fenced(HEAD + "shape = Manifold.cube([20, 20, 4])\n" + SAVE)
    score, result = await run(cad, box, plate, text)
    verdict = read_verdict(plate, text, result)
    assert verdict is not None and verdict["euler"] == 2
    assert score == pytest.approx(3 / 5)  # watertight, extents, bodies


async def test_no_script_and_crashing_script_score_zero(cad: Cad, box: ProcessSandbox) -> None:
    assert cad.exec_request(BOX, "") is None
    assert cad.score(BOX, "", None) == 0.0
    score, result = await run(cad, box, BOX, fenced(HEAD + "shape = Manifold.cube(\n"))
    assert score == 0.0 and json.loads(result.stdout.split(b" ", 1)[1])["built"] is False


async def test_printing_passed_and_a_fake_verdict_scores_zero(
    cad: Cad, box: ProcessSandbox
) -> None:
    fake = json.dumps({"built": True, "vertices": 8, "edges": 18, "faces": 12, "euler": 2,
                       "bodies": 1, "exit_code": 0, "watertight": True,
                       "winding_consistent": True, "volume": 6000.0,
                       "extents": [10.0, 20.0, 30.0]})
    text = fenced(f"print('PASSED')\nprint('{'0' * 64} {fake}')\nprint('ALL TESTS PASSED')\n")
    score, result = await run(cad, box, BOX, text)
    assert score == 0.0
    # its output comes back only as an escaped diagnostic inside the driver's one line
    [only] = result.stdout.splitlines()
    assert json.loads(only.split(b" ", 1)[1])["built"] is False


async def test_exiting_zero_early_without_a_mesh_scores_zero(
    cad: Cad, box: ProcessSandbox
) -> None:
    text = fenced("import os\nos._exit(0)\n" + BOX_SCRIPT)
    score, result = await run(cad, box, BOX, text)
    assert score == 0.0
    assert result.exit_code == 0  # the driver itself finished: the verdict was "not built"
    assert b"no out.npz or out.stl" in result.stdout


async def test_planted_trimesh_and_numpy_are_not_imported_by_the_checker(
    cad: Cad, box: ProcessSandbox
) -> None:
    # Given a script that builds a wrong (small) cube and plants fake trimesh / numpy /
    # sitecustomize modules that would report the task's perfect numbers, in its own dir,
    # in the work dir and in $HOME
    fake = ("import json, sys\nprint(json.dumps({'built': True, 'vertices': 8, 'edges': 18, "
            "'faces': 12, 'euler': 2, 'bodies': 1, 'watertight': True, "
            "'winding_consistent': True, 'volume': 6000.0, 'extents': [10.0, 20.0, 30.0]}))\n"
            "sys.exit(0)\n")
    plant = (
        "import os\n"
        f"FAKE = {fake!r}\n"
        "for d in ['.', '..', os.path.expanduser('~'), '/tmp']:\n"
        "    os.makedirs(os.path.join(d, 'trimesh'), exist_ok=True)\n"
        "    for name in ['trimesh/__init__.py', 'numpy.py', 'sitecustomize.py',\n"
        "                 'usercustomize.py', 'checker.py']:\n"
        "        with open(os.path.join(d, name), 'w') as f:\n"
        "            f.write(FAKE)\n"
    )
    text = fenced(HEAD + "shape = Manifold.cube([2, 2, 2])\n" + SAVE + plant)
    # When it runs, Then only the honest measurements of the 2 mm cube count
    score, result = await run(cad, box, BOX, text)
    verdict = read_verdict(BOX, text, result)
    assert verdict is not None and verdict["volume"] == pytest.approx(8.0)
    assert score == pytest.approx(3 / 5)


async def test_a_daemon_waiting_to_patch_the_checker_is_killed_first(
    cad: Cad, box: ProcessSandbox
) -> None:
    # Given a script that builds a wrong cube, then leaves a daemon (double fork, new
    # session) that overwrites every checker.py / mesh it finds for the next 10 seconds
    daemon = (
        "import os, glob, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        end = time.time() + 10\n"
        "        while time.time() < end:\n"
        "            for p in glob.glob('/work/*/checker.py') + glob.glob('/tmp/*/checker.py'):\n"
        "                open(p, 'w').write('print(1/0)')\n"
        "            time.sleep(0.005)\n"
        "    os._exit(0)\n"
    )
    text = fenced(HEAD + "shape = Manifold.cube([2, 2, 2])\n" + SAVE + daemon)
    with trio.fail_after(30):
        score, result = await run(cad, box, BOX, text)
    verdict = read_verdict(BOX, text, result)
    assert verdict is not None and verdict["built"] is True  # the checker ran unpatched
    assert score == pytest.approx(3 / 5)


async def test_overwriting_the_staged_driver_changes_nothing(
    cad: Cad, box: ProcessSandbox
) -> None:
    patch = "open('../cad_driver.py', 'w').write('print(\"PASSED\")')\n"
    score, _ = await run(cad, box, BOX, fenced(BOX_SCRIPT + patch))
    assert score == 1.0


async def test_a_valid_but_empty_shape_scores_zero(cad: Cad, box: ProcessSandbox) -> None:
    text = fenced(HEAD + "shape = Manifold.cube([10, 20, 30]) - Manifold.cube([10, 20, 30])\n"
                  + SAVE)
    score, result = await run(cad, box, BOX, text)
    assert score == 0.0 and b"empty" in result.stdout


async def test_giant_outputs_score_what_they_built(cad: Cad, box: ProcessSandbox) -> None:
    # a flood of stdout does not disturb the verdict; a giant mesh file is refused
    flood = "import sys\nfor _ in range(400):\n    sys.stdout.write('PASSED ' * 20000)\n"
    score, result = await run(cad, box, BOX, fenced(flood + BOX_SCRIPT))
    assert score == 1.0 and result.stdout_dropped == 0
    huge = ("import numpy as np\n"
            "np.savez('out.npz', vertices=np.zeros((2_000_000, 3)), "
            "faces=np.zeros((2_000_000, 3), dtype=np.int64))\n")
    score, _ = await run(cad, box, BOX, fenced(huge))
    assert score == 0.0
    many = HEAD + "shape = Manifold.sphere(15, 1200)\n" + SAVE  # > 200,000 faces
    score, _ = await run(cad, box, item("sphere", 4 / 3 * math.pi * 15**3, (30, 30, 30)),
                         fenced(many))
    assert score == 0.0


async def test_an_open_mesh_claimed_as_solid_loses_the_solid_constraints(
    cad: Cad, box: ProcessSandbox
) -> None:
    # the right box with one triangle missing (and, separately, turned inside out)
    open_box = HEAD + ("shape = Manifold.cube([10, 20, 30])\nmesh = shape.to_mesh()\n"
                       "np.savez('out.npz', vertices=mesh.vert_properties[:, :3], "
                       "faces=mesh.tri_verts[1:])\n")
    text = fenced(open_box)
    score, result = await run(cad, box, BOX, text)
    verdict = read_verdict(BOX, text, result)
    assert verdict is not None and verdict["watertight"] is False
    assert constraints(BOX, verdict) == {"watertight": False, "volume": False,
                                         "extents": True, "genus": False, "bodies": True}
    assert score == pytest.approx(2 / 5)
    inverted = open_box.replace("faces=mesh.tri_verts[1:]", "faces=mesh.tri_verts[:, ::-1]")
    score, _ = await run(cad, box, BOX, fenced(inverted))
    assert score == pytest.approx(2 / 5)  # closed, but its volume is negative: not a solid


async def test_a_script_that_never_ends_scores_zero(cad: Cad, box: ProcessSandbox) -> None:
    text = fenced(BOX_SCRIPT + "import time\ntime.sleep(1000)\n")
    with trio.fail_after(30):
        score, result = await run(cad, box, BOX, text)
    assert score == 0.0 and b"timed out" in result.stdout


def test_forged_or_inconsistent_verdicts_are_refused() -> None:
    # the host's validation, on results as the sandbox would return them
    text = fenced(BOX_SCRIPT)
    good = {"built": True, "vertices": 8, "edges": 18, "faces": 12, "euler": 2, "bodies": 1,
            "exit_code": 0, "watertight": True, "winding_consistent": True,
            "volume": 6000.0, "extents": [10.0, 20.0, 30.0]}

    def result(line: str) -> ExecResult:
        return ExecResult(exit_code=0, stdout=line.encode() + b"\n", stderr=b"",
                          timed_out=False, oom_killed=False, duration_s=1.0)

    def line(v: dict[str, object], key: str | None = None) -> str:
        return f"{key or nonce(BOX, text)} {json.dumps(v)}"

    cad = Cad()
    assert cad.score(BOX, text, result(line(good))) == 1.0
    assert cad.score(BOX, text, result(line(good, "f" * 64))) == 0.0  # wrong nonce
    assert cad.score(BOX, text, result(line(good) + "\n" + line(good))) == 0.0
    for bad in ({"euler": 3}, {"edges": 20, "euler": 0}, {"volume": 1e9}, {"bodies": True},
                {"volume": "6000"}, {"extents": [10.0, 20.0]}, {"exit_code": 1},
                {"extra": 1}):
        assert cad.score(BOX, text, result(line({**good, **bad}))) == 0.0, bad


async def test_a_primed_completion_needs_only_the_shape(cad: Cad, box: ProcessSandbox) -> None:
    # the prompt ends with ANSWER_PREFIX ("```python ... shape = Manifold."): the model goes on,
    # and the driver saves the global `shape` for it
    from streamrl.domains.cad.domain import ANSWER_PREFIX

    assert ANSWER_PREFIX.endswith("shape = Manifold.")
    score, _ = await run(cad, box, BOX, "cube([10, 20, 30])\n```\nThis is a box.")
    assert score == 1.0
    score, _ = await run(cad, box, BOX, "cube([10, 20])\n```")  # a TypeError
    assert score == 0.0


async def test_a_script_cut_off_at_the_token_limit_is_no_script(
    cad: Cad, box: ProcessSandbox
) -> None:
    # the same cube, closed, scores; unclosed (the completion stopped at its token limit), it
    # is no script at all: whether its lines run would depend on where the limit cut them
    closed = "cube([10, 20, 30])\nshape = shape.translate([0, 0, 0])\n```"
    score, _ = await run(cad, box, BOX, closed)
    assert score == 1.0
    for cut in (closed[:-3], closed[:-3] + "shape = shape.trans", "cube([10, 20, 30])\n"):
        assert program(cut) == ""
        assert cad.exec_request(BOX, cut) is None
        assert cad.score(BOX, cut, None) == 0.0
    # a block the completion opened itself must be closed too
    own = "Here:\n```python\n" + HEAD + "shape = Manifold.cube([10, 20, 30])\n"
    assert program(own) == ""
    assert program(own + "```") == HEAD + "shape = Manifold.cube([10, 20, 30])"
