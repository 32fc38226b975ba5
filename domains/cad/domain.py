"""The ``cad`` domain: write a script that builds a 3D solid; geometry decides, in the sandbox.

The model writes a Python script that builds the shape the task describes with manifold3d
(CSG: cubes, cylinders, spheres, boolean operations) into a global ``shape`` (saved for it),
or saves a mesh to ``out.npz`` / ``out.stl`` itself. The assistant turn is primed with
``ANSWER_PREFIX`` (an opened ```python block, the import, ``shape = Manifold.``): ``render_prompt``
appends it, and the program is the first fenced block of prefix + completion, unless the
completion opens its own block first (its first fence carries a language tag), then that.
A block the completion never closed (it stopped at its token limit mid-script) is no script:
which of its lines run would depend on where the limit cut it, and under RL the model learned
to exploit that (issue 18: after 5 steps of ``configs/multi.toml`` its completions repeated
one line to the limit, and a cut that left valid syntax still scored the cube's 0.6).
The sandbox runs ``python3 -I -S cad_driver.py`` (:mod:`domains.cad.driver`): the script
runs in a child, everything it started is killed, and only then is the checker
(:mod:`domains.cad.checker`) staged and run on a copy of the mesh. The checker only measures
(it never sees the task); the driver prints ``<nonce> <json measurements>``;
:meth:`Cad.score` validates that line (nonce, exit code, exact fields and types, internal
consistency: V - E + F equals the Euler number, a closed triangle mesh has 2E = 3F, the
volume fits in the bounding box) and compares it with the
task here, on the host.

A failure of the check itself is no reward (:class:`~streamrl.domains.base.VerifierFailed`,
issue 32 item 3): the driver found no CAD runtime (its marker file), the checker raised
(it cannot import numpy/trimesh; it never sees the task, and it catches what a mesh file
does to it) or printed no verdict, or the driver itself crashed. What the model's script
does (crashing, timing out, a directory or fifo for its mesh, killing its driver, a mesh
the checker runs out of time or memory on) still scores 0.

Reward: 0 when the shape does not build (no closed fenced script, the script fails or times out, no
mesh, an empty or unreadable or over-large mesh, a verdict that does not validate); else the
fraction of :data:`CONSTRAINTS` met:
- ``watertight``: closed (every edge in exactly two faces), consistently wound, volume > 0;
- ``volume``: within ``VOLUME_TOL`` (relative) of the task's (only for a watertight mesh);
- ``extents``: the bounding box's size along x, y and z, each within ``EXTENT_REL`` (relative)
  or ``EXTENT_ABS``;
- ``genus``: the number of through-holes, (2 * bodies - Euler number) / 2 (watertight only);
- ``bodies``: the number of separate pieces.

Where it runs: the process backend by default (``sandbox.backend``), with the CAD runtime
(:mod:`domains.cad.runtime`, installed under /usr so that bwrap shows it). The offline Docker
image has no pip packages; see docs/domains.md for what it would need.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import re
from pathlib import Path
from typing import Any

import msgspec
import structlog

from streamrl.domains.base import (
    SINGLE_TURN,
    SandboxSpec,
    SplitFiles,
    VerifierFailed,
    chat_prompt_ids,
)
from streamrl.domains.cad.runtime import MARKER, runtime_dir
from streamrl.domains.fences import PYTHON, fence
from streamrl.domains.kinds.harness_host import check_harness
from streamrl.sandbox.base import ExecRequest, ExecResult, Limits

log = structlog.get_logger()

DATA_DIR = Path(__file__).parent / "data"
DRIVER = "cad_driver.py"
DRIVER_SOURCE = (Path(__file__).parent / "driver.py").read_bytes()
CHECKER_SOURCE = (Path(__file__).parent / "checker.py").read_text()
KEY_ENV = "STREAMRL_VERIFY_KEY"
MAX_NEW_TOKENS = 64  # calibration.json: greedy 0.31 at 32-48 tokens, 0.46 at 64
SCRIPT_TIMEOUT_S = 20.0
CHECK_TIMEOUT_S = 15.0
MAX_MESH_BYTES = 8 << 20
LIMITS = Limits(timeout_s=SCRIPT_TIMEOUT_S + CHECK_TIMEOUT_S + 10.0, memory_mb=1024, cpu_s=45,
                max_processes=32, max_file_mb=16, output_bytes=64 << 10)
VOLUME_TOL = 0.05
EXTENT_REL = 0.03
EXTENT_ABS = 0.1
CONSTRAINTS = ("watertight", "volume", "extents", "genus", "bodies")
ANSWER_PREFIX = "```python\nfrom manifold3d import Manifold\n\nshape = Manifold."
_OWN_BLOCK = re.compile(r"```[ \t]*[A-Za-z]")
_CLOSED_BLOCK = fence(PYTHON, closed=True)

_INTS = ("vertices", "edges", "faces", "euler", "bodies", "exit_code")
_BOOLS = ("built", "watertight", "winding_consistent")
_BUILT_KEYS = {*_INTS, *_BOOLS, "volume", "extents"}


class CadItem(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    prompt: str
    kind: str
    volume: float
    extents: list[float]  # size of the bounding box along x, y, z
    genus: int
    bodies: int
    reference: str  # hidden: a script that builds the shape (the data's own check)
    salt: str  # hidden; the nonce key when no $STREAMRL_VERIFY_KEY


def nonce(item: CadItem, completion_text: str) -> str:
    key = (os.environ.get(KEY_ENV) or item.salt).encode()
    msg = item.id.encode() + b"\0" + completion_text.encode("utf-8", "replace")
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def program(completion_text: str) -> str:
    """The script: the primed block continued, or a block the completion opened itself; only
    a block the completion closed ("" for one cut off at the token limit)."""
    if not completion_text.strip():
        return ""
    fence = completion_text.find("```")
    own = fence >= 0 and _OWN_BLOCK.match(completion_text, fence)
    match = _CLOSED_BLOCK.search(completion_text if own else ANSWER_PREFIX + completion_text)
    return match.group(1).strip() if match else ""


def read_verdict(item: CadItem, completion_text: str, result: ExecResult | None
                 ) -> dict[str, Any] | None:
    """The driver's measurements if the run produced exactly one well-formed, authentic,
    internally consistent verdict line; else None."""
    if result is None or result.timed_out or result.exit_code != 0 or result.stdout_dropped:
        return None
    lines = result.stdout.decode("utf-8", "replace").strip().splitlines()
    if len(lines) != 1:
        return None
    head, _, body = lines[0].partition(" ")
    if not hmac.compare_digest(head, nonce(item, completion_text)):
        return None
    try:
        verdict = json.loads(body, parse_constant=lambda c: None)
    except (ValueError, RecursionError):
        return None
    return verdict if type(verdict) is dict and valid(verdict) else None


def valid(v: dict[str, Any]) -> bool:
    """Exact fields and types of a built verdict, and the identities a real mesh satisfies."""
    if v.get("built") is not True:
        return type(v.get("built")) is bool
    if set(v) != _BUILT_KEYS:
        return False
    if any(type(v[k]) is not int for k in _INTS) or any(type(v[k]) is not bool for k in _BOOLS):
        return False
    extents = v["extents"]
    if type(extents) is not list or len(extents) != 3:
        return False
    numbers = [v["volume"], *extents]
    if any(type(x) is not float or not math.isfinite(x) for x in numbers):
        return False
    if min(extents) < 0 or v["faces"] < 1 or not 1 <= v["bodies"] <= v["vertices"]:
        return False
    if v["euler"] != v["vertices"] - v["edges"] + v["faces"]:
        return False
    if v["watertight"] and 2 * v["edges"] != 3 * v["faces"]:
        return False
    box = extents[0] * extents[1] * extents[2]
    return abs(v["volume"]) <= box * (1 + 1e-6) + 1e-9


def constraints(item: CadItem, v: dict[str, Any]) -> dict[str, bool]:
    """Which of :data:`CONSTRAINTS` a built, validated verdict meets for ``item``."""
    solid = v["watertight"] and v["winding_consistent"] and v["volume"] > 0
    holes2 = 2 * v["bodies"] - v["euler"]
    return {
        "watertight": solid,
        "volume": solid and abs(v["volume"] - item.volume) <= VOLUME_TOL * item.volume,
        "extents": all(abs(a - b) <= max(EXTENT_ABS, EXTENT_REL * b)
                       for a, b in zip(v["extents"], item.extents, strict=True)),
        "genus": solid and holes2 % 2 == 0 and holes2 // 2 == item.genus,
        "bodies": v["bodies"] == item.bodies,
    }


class Cad(SplitFiles):
    name = "cad"
    item_type = CadItem
    default_max_new_tokens = MAX_NEW_TOKENS
    episode = SINGLE_TURN
    sandbox = SandboxSpec(backend="process", limits=LIMITS, files={DRIVER: DRIVER_SOURCE})

    def __init__(self, data_dir: Path = DATA_DIR, runtime: Path | None = None,
                 script_timeout_s: float = SCRIPT_TIMEOUT_S) -> None:
        self.data_dir = data_dir
        self.runtime = runtime or runtime_dir()
        self.script_timeout_s = script_timeout_s
        if not (self.runtime / MARKER).exists():
            log.warning("cad runtime missing: every cad script will fail to import",
                        runtime=str(self.runtime), fix="python -m streamrl.domains.cad.runtime")

    def render_prompt(self, item: CadItem, tokenizer: Any) -> list[int]:
        primed = tokenizer.encode(ANSWER_PREFIX, add_special_tokens=False)
        return chat_prompt_ids(tokenizer, item.prompt) + [int(i) for i in primed]

    def exec_request(self, item: CadItem, completion_text: str) -> ExecRequest | None:
        source = program(completion_text)
        if not source:
            return None
        spec = {
            "nonce": nonce(item, completion_text),
            "source": source,
            "runtime": str(self.runtime),
            "checker": CHECKER_SOURCE,
            "script_timeout_s": self.script_timeout_s,
            "check_timeout_s": CHECK_TIMEOUT_S,
            "max_mesh_bytes": MAX_MESH_BYTES,
        }
        return ExecRequest(argv=["python3", "-I", "-S", DRIVER], files=dict(self.sandbox.files),
                           stdin=json.dumps(spec).encode(), limits=LIMITS)

    def score(self, item: CadItem, completion_text: str, result: ExecResult | None) -> float:
        """The fraction of :data:`CONSTRAINTS` met; 0 when the shape does not build.
        :class:`VerifierFailed` when the check itself failed: the driver found no CAD
        runtime or the checker crashed (an authentic verdict says ``unjudged``), or the
        driver crashed (``harness_host.check_harness``)."""
        verdict = read_verdict(item, completion_text, result)
        if verdict is None:
            check_harness(result)
            return 0.0
        if type(verdict.get("unjudged")) is str:
            raise VerifierFailed(f"cad: {verdict['unjudged']}"[:300])
        if not verdict["built"] or verdict["exit_code"] != 0:
            return 0.0
        met = constraints(item, verdict)
        return sum(met.values()) / len(met)
