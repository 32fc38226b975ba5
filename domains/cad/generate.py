"""Write ``data/train.jsonl`` and ``data/eval.jsonl`` for the cad domain, deterministically.

    python -m streamrl.domains.cad.generate [--seed 11] [--train 300] [--eval 32]

Each task is a shape family with fresh dimensions (whole millimetres): a box, a cylinder, a
sphere, a tube, a plate with one or two round through-holes, an L-bracket, two separate
cubes. The expected volume, bounding-box size, genus and body count are computed in closed
form here (a polygonal cylinder or sphere is a little smaller: the tolerances in
:mod:`domains.cad.domain` cover manifold3d's default tessellation for the radii used), and a
reference script that builds the shape is kept with the item (hidden from the model; the
tests run it through the real sandbox).
"""

from __future__ import annotations

import argparse
import math
import random
from pathlib import Path

from streamrl.domains import base
from streamrl.domains.base import unique_splits
from streamrl.domains.cad.domain import DATA_DIR, CadItem

SEED = 11

EXAMPLE = "from manifold3d import Manifold\n\nshape = Manifold.cube([10, 10, 10])\n"
PROMPT = (
    "Write a Python script that uses the manifold3d library to build this 3D solid: {desc} "
    "Sizes are in mm. Put the solid in a variable named shape (it is saved for you), like "
    "this script, which builds a 10 x 10 x 10 cube:\n```python\n" + EXAMPLE + "```\n"
    "Other parts: Manifold.cylinder(height, radius) (axis along z from z=0), "
    "Manifold.sphere(radius), shape.translate([x, y, z]), a + b (union), a - b "
    "(difference). Reply with the whole script in one ```python block."
)
SAVE = 'mesh = shape.to_mesh()\nnp.savez("out.npz", vertices=mesh.vert_properties[:, :3], ' \
       'faces=mesh.tri_verts)\n'
HEAD = "from manifold3d import Manifold\nimport numpy as np\n"

Shape = tuple[str, str, float, list[float], int, int, str]
"""(kind, description, volume, extents, genus, bodies, reference body)."""


def shape(rng: random.Random) -> Shape:
    d = rng.randint
    kind = rng.choice(["box", "cylinder", "sphere", "tube", "plate_hole", "plate_two_holes",
                       "l_bracket", "two_cubes"])
    if kind == "box":
        a, b, c = d(2, 40), d(2, 40), d(2, 40)
        return (kind, f"a solid box {a} mm along x, {b} mm along y and {c} mm along z.",
                a * b * c, [a, b, c], 0, 1, f"shape = Manifold.cube([{a}, {b}, {c}])\n")
    if kind == "cylinder":
        r, h = d(3, 15), d(2, 40)
        return (kind, f"a solid cylinder of radius {r} mm and height {h} mm, axis along z.",
                math.pi * r * r * h, [2 * r, 2 * r, h], 0, 1,
                f"shape = Manifold.cylinder({h}, {r})\n")
    if kind == "sphere":
        r = d(5, 20)
        return (kind, f"a solid sphere of radius {r} mm.", 4 / 3 * math.pi * r**3,
                [2 * r] * 3, 0, 1, f"shape = Manifold.sphere({r})\n")
    if kind == "tube":
        r = d(3, 12)
        big, h = r + d(2, 8), d(3, 40)
        return (kind, f"a tube (a hollow cylinder, open at both ends) of outer radius {big} "
                f"mm, inner radius {r} mm and height {h} mm, axis along z.",
                math.pi * (big * big - r * r) * h, [2 * big, 2 * big, h], 1, 1,
                f"shape = Manifold.cylinder({h}, {big}) - "
                f"Manifold.cylinder({h + 2}, {r}).translate([0, 0, -1])\n")
    if kind in ("plate_hole", "plate_two_holes"):
        n = 1 if kind == "plate_hole" else 2
        r = d(3, 6)
        a, b, t = d(2 * r + 4, 50) * n, d(2 * r + 4, 50), d(2, 10)
        xs = [a / 2] if n == 1 else [a / 4, 3 * a / 4]
        holes = " + ".join(f"Manifold.cylinder({t + 2}, {r}).translate([{x:g}, {b / 2:g}, -1])"
                           for x in xs)
        what = "a round hole" if n == 1 else "two round holes"
        return (kind, f"a flat plate {a} mm along x, {b} mm along y and {t} mm thick (z), with "
                f"{what} of radius {r} mm going through it along z.",
                a * b * t - n * math.pi * r * r * t, [a, b, t], n, 1,
                f"shape = Manifold.cube([{a}, {b}, {t}]) - ({holes})\n")
    if kind == "l_bracket":
        a, b, c, t = d(10, 40), d(5, 30), d(10, 40), d(2, 6)
        return (kind, f"an L-shaped bracket: a base plate {a} mm along x, {b} mm along y and "
                f"{t} mm thick, and a wall {t} mm thick standing on one end of it (at x = 0), "
                f"reaching {c} mm high in total (z).", a * b * t + t * b * (c - t), [a, b, c],
                0, 1, f"shape = Manifold.cube([{a}, {b}, {t}]) + Manifold.cube([{t}, {b}, {c}])\n")
    a, gap = d(3, 20), d(2, 10)
    return (kind, f"two separate cubes of side {a} mm, side by side along x with a gap of {gap} "
            f"mm between them.", 2 * a**3, [2 * a + gap, a, a], 0, 2,
            f"shape = Manifold.cube([{a}, {a}, {a}]) + "
            f"Manifold.cube([{a}, {a}, {a}]).translate([{a + gap}, 0, 0])\n")


def make_item(rng: random.Random, split: str, index: int) -> CadItem:
    kind, desc, volume, extents, genus, bodies, body = shape(rng)
    return CadItem(
        id=f"cad-{split}-{index:05d}", prompt=PROMPT.format(desc=desc), kind=kind,
        volume=round(float(volume), 6), extents=[float(e) for e in extents], genus=genus,
        bodies=bodies, reference=HEAD + body + SAVE, salt=f"{rng.getrandbits(128):032x}",
    )


def make_splits(seed: int = SEED, n_train: int = 300, n_eval: int = 32
                ) -> dict[str, list[CadItem]]:
    rng = random.Random(seed)
    return unique_splits(lambda split, i: make_item(rng, split, i), n_eval, n_train)


def write_splits(splits: dict[str, list[CadItem]], data_dir: Path = DATA_DIR) -> None:
    base.write_splits(splits, data_dir)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--train", type=int, default=300)
    ap.add_argument("--eval", type=int, default=32)
    args = ap.parse_args()
    write_splits(make_splits(args.seed, args.train, args.eval))


if __name__ == "__main__":
    main()
