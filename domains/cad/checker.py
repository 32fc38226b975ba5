"""The cad domain's checker: staged by the driver AFTER the model's script is dead, run as
``python3 -I -S checker.py <runtime dir> <mesh file>`` in a fresh directory.

It measures; it does not judge (it never sees the task). One JSON object on stdout:
``{"built": true, "vertices", "edges", "faces", "watertight", "winding_consistent",
"volume", "extents": [x, y, z], "euler", "bodies"}`` or ``{"built": false, "error"}``.

- ``out.npz``: ``vertices`` (n, 3) finite floats and ``faces`` (m, 3) ints in range, loaded
  with ``allow_pickle=False``; ``out.stl``: loaded by trimesh. Duplicate vertices are merged.
- more than ``MAX_FACES`` faces, or none: not built (an empty shape is not a shape);
- ``watertight``: every edge is shared by exactly two faces (trimesh); ``winding_consistent``:
  the two faces of every edge traverse it in opposite directions; ``volume``: the signed
  volume (meaningful only when both hold);
- ``euler`` = V - E + F; ``bodies``: connected components of the vertex-edge graph
  (union-find in numpy; trimesh's ``body_count`` would need scipy).
"""

import json
import sys

MAX_FACES = 200_000


def components(n_vertices, edges, np):
    parent = np.arange(n_vertices)
    while True:
        low = np.minimum(parent[edges[:, 0]], parent[edges[:, 1]])
        before = parent.copy()
        np.minimum.at(parent, edges[:, 0], low)
        np.minimum.at(parent, edges[:, 1], low)
        parent = parent[parent]
        if np.array_equal(parent, before):
            return parent


def load(path, np, trimesh):
    if path.endswith(".npz"):
        with np.load(path, allow_pickle=False) as z:
            vertices = np.asarray(z["vertices"], dtype=np.float64)
            faces = np.asarray(z["faces"])
        if vertices.ndim != 2 or vertices.shape[1] != 3 or faces.ndim != 2 or faces.shape[1] != 3:
            raise ValueError("vertices and faces must be (n, 3) arrays")
        if faces.dtype.kind not in "iu" or not np.isfinite(vertices).all():
            raise ValueError("faces must be integers and vertices finite")
        if len(faces) > MAX_FACES:
            raise ValueError(f"more than {MAX_FACES} faces")
        if len(faces) and (faces.min() < 0 or faces.max() >= len(vertices)):
            raise ValueError("a face index is out of range")
        return trimesh.Trimesh(vertices=vertices, faces=faces.astype(np.int64), process=True)
    mesh = trimesh.load(path, file_type="stl", force="mesh", process=True)
    if len(mesh.faces) > MAX_FACES or not np.isfinite(mesh.vertices).all():
        raise ValueError(f"more than {MAX_FACES} faces, or vertices not finite")
    return mesh


def measure(path, np, trimesh):
    mesh = load(path, np, trimesh)
    mesh.remove_unreferenced_vertices()
    if len(mesh.faces) == 0:
        return {"built": False, "error": "the mesh is empty"}
    edges = mesh.edges_unique
    parent = components(len(mesh.vertices), edges, np)
    return {
        "built": True,
        "vertices": len(mesh.vertices),
        "edges": len(edges),
        "faces": len(mesh.faces),
        "watertight": bool(mesh.is_watertight),
        "winding_consistent": bool(mesh.is_winding_consistent),
        "volume": float(mesh.volume),
        "extents": [float(x) for x in mesh.extents],
        "euler": int(mesh.euler_number),
        "bodies": len(np.unique(parent)),
    }


def main():
    sys.path.insert(0, sys.argv[1])
    import numpy as np  # a runtime it cannot import is the checker's failure: exit 1
    import trimesh

    try:
        verdict = measure(sys.argv[2], np, trimesh)
    except Exception as exc:  # a mesh file that cannot be read is data, not a crash
        verdict = {"built": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
    if verdict.get("built") and not all(
        isinstance(x, float) and x == x and abs(x) < 1e30
        for x in [verdict["volume"], *verdict["extents"]]
    ):
        verdict = {"built": False, "error": "measurements are not finite"}
    sys.stdout.write(json.dumps(verdict, allow_nan=False))


if __name__ == "__main__":
    main()
