"""The cad domain tells a failure of its own check from a wrong shape (issue 32 item 3): a
CAD runtime that is missing, a checker that crashed or cannot import its libraries, a
driver that crashed are :class:`~streamrl.domains.base.VerifierFailed`, never a reward of 0;
what the model's script did (crashing, leaving a directory where its mesh should be,
killing its driver) still scores 0. Real process sandbox and CAD runtime."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from streamrl.domains.base import VerifierFailed
from streamrl.domains.cad import Cad
from streamrl.domains.cad.domain import CHECKER_SOURCE
from streamrl.sandbox.process import ProcessSandbox
from tests.domains.test_cad import BOX, BOX_SCRIPT, HEAD, box, cad, fenced, run

__all__ = ["box", "cad"]  # the fixtures, shared with test_cad


async def with_checker(cad: Cad, box: ProcessSandbox, checker: str) -> float:
    request = cad.exec_request(BOX, fenced(BOX_SCRIPT))
    assert request is not None
    spec = {**json.loads(request.stdin), "checker": checker}
    result = await box.run(dataclasses.replace(request, stdin=json.dumps(spec).encode()))
    return cad.score(BOX, fenced(BOX_SCRIPT), result)


async def test_a_missing_cad_runtime_is_a_verifier_failure(box: ProcessSandbox) -> None:
    # Given a deployment whose CAD runtime is not where the domain looks for it
    absent = Cad(runtime=Path("/usr/local/lib/streamrl-cad-absent"), script_timeout_s=6.0)
    request = absent.exec_request(BOX, fenced(BOX_SCRIPT))
    assert request is not None
    result = await box.run(request)
    # When a right script is scored, Then the domain says it could not judge it
    with pytest.raises(VerifierFailed, match="CAD runtime"):
        absent.score(BOX, fenced(BOX_SCRIPT), result)


async def test_a_checker_that_crashes_is_a_verifier_failure(cad: Cad, box: ProcessSandbox
                                                            ) -> None:
    # Given the real checker a right script scores 1; When the checker raises (it cannot
    # import its runtime, or fails) or prints no verdict, Then the domain cannot judge it
    assert await with_checker(cad, box, CHECKER_SOURCE) == 1.0
    with pytest.raises(VerifierFailed, match=r"the checker failed.*ModuleNotFoundError"):
        await with_checker(cad, box, "import trimesh_absent\n")
    with pytest.raises(VerifierFailed, match=r"the checker failed.*RuntimeError: boom"):
        await with_checker(cad, box, "raise RuntimeError('boom')\n")
    with pytest.raises(VerifierFailed, match="the checker's output has no verdict"):
        await with_checker(cad, box, "print('[1, 2]')\n")


async def test_a_driver_that_crashes_is_a_verifier_failure(cad: Cad, box: ProcessSandbox
                                                           ) -> None:
    request = cad.exec_request(BOX, fenced(BOX_SCRIPT))
    assert request is not None
    result = await box.run(dataclasses.replace(request, stdin=b"{}"))
    with pytest.raises(VerifierFailed, match="the harness crashed: KeyError"):
        cad.score(BOX, fenced(BOX_SCRIPT), result)


@pytest.mark.parametrize("script", [
    "import os\nos.mkdir('out.npz')\n",
    "import os\nos.mkdir('out.stl')\nos.chmod('.', 0o500)\n",
    "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n",
    "import os, signal\nos.kill(os.getppid(), signal.SIGINT)\nimport time\ntime.sleep(2)\n",
    "shape = Manifold.cube(\n",
], ids=["mesh-is-a-directory", "unreadable-dir", "kills-driver", "interrupts-driver", "crash"])
async def test_what_the_script_does_still_scores_zero(cad: Cad, box: ProcessSandbox,
                                                      script: str) -> None:
    score, _ = await run(cad, box, BOX, fenced(HEAD + script))
    assert score == 0.0
