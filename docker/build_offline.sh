#!/usr/bin/env bash
# Build the project image on a machine without an image registry (CI, air-gapped hosts).
# Users with a registry build docker/Dockerfile instead (public python base).
#
#   docker/build_offline.sh [TAG]          (default streamrl:offline)
#
# 1. base: the sandbox's offline Debian image (sandbox/images/build_offline.sh: debootstrap +
#    docker import, python3 only; built once per tag);
# 2. lock: what pip resolves for pyproject's dependencies, torch pinned to 2.13.0 (the CPU
#    build on disk; any other torch or a CUDA wheel fails the build), versions constrained
#    to the repo's .venv when there is one (a dry run: metadata only);
# 3. deps image (docker/Dockerfile.offline-deps): a venv made from a wheelhouse that pip
#    fills on this host ($STREAMRL_WHEELHOUSE; wheels where PyPI has them, built here from
#    the sdist where it has none: reasoning-gym's cellpylib, pycosat and zss), tagged
#    streamrl-deps:<hash of the lock>, so it is built once and reused until a locked wheel
#    changes;
# 4. the project image (docker/Dockerfile.offline): the deps image plus the project's wheel.
# A warm rebuild (only the project's source changed) is steps 2 and 4: seconds.
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

python3 docker/lock.py requirements "$work/deps/requirements.txt"
# the resolution is cached by the hash of what went into it
inputs=$(cat "$work/deps/requirements.txt" "$work/deps/requirements.txt.constraints" \
         docker/lock.py | sha256sum | cut -c1-16)
mkdir -p "$wheels/locks"
if [ ! -s "$wheels/locks/$inputs.txt" ]; then
    quiet $pip install -q --dry-run --ignore-installed --prefer-binary \
        --report "$work/deps/report.json" \
        -r "$work/deps/requirements.txt" -c "$work/deps/requirements.txt.constraints"
    python3 docker/lock.py lock "$work/deps/report.json" "$wheels/locks/$inputs.txt"
fi
cp "$wheels/locks/$inputs.txt" "$work/deps/lock.txt"
hash=$( (cat "$work/deps/lock.txt" docker/Dockerfile.offline-deps; echo "$base") \
        | sha256sum | cut -c1-12)
deps_tag="streamrl-deps:$hash"

if docker image inspect "$deps_tag" >/dev/null 2>&1; then
    echo "deps image $deps_tag already present"
else
    quiet $pip wheel -q --no-deps --prefer-binary --wheel-dir "$wheels" -r "$work/deps/lock.txt"
    quiet $pip download -q --no-deps --only-binary :all: --dest "$wheels" pip
    mkdir -p "$work/deps/wheels"
    while read -r pin; do  # only the locked wheels go into the build context
        name=${pin%%==*}; version=${pin#*==}
        found=$(ls "$wheels" | grep -i "^${name//-/[-_.]}-${version}-" | head -1)
        [ -n "$found" ] || { echo "no wheel for $pin in $wheels" >&2; exit 1; }
        cp -l "$wheels/$found" "$work/deps/wheels/" 2>/dev/null || cp "$wheels/$found" "$work/deps/wheels/"
    done < "$work/deps/lock.txt"
    cp "$(ls "$wheels"/pip-*.whl | sort -V | tail -1)" "$work/deps/wheels/"
    cp docker/Dockerfile.offline-deps "$work/deps/Dockerfile"
    docker build -q --build-arg "BASE=$base" -t "$deps_tag" "$work/deps" >/dev/null
    docker image prune -f --filter label=streamrl.build-stage=1 >/dev/null  # its build stage
    echo "built $deps_tag"
fi

# The project: its wheel (package data and the streamrl.domains entry points included).
build_isolation=()  # the venv's setuptools when it has one: no isolated build env to set up
"${pip%/pip}/python" -c "import setuptools" 2>/dev/null && build_isolation=(--no-build-isolation)
SOURCE_DATE_EPOCH=315532800 quiet $pip wheel -q --no-deps "${build_isolation[@]}" --wheel-dir "$work/app" .  # same source, same bytes
cp "$(ls "$wheels"/pip-*.whl | sort -V | tail -1)" "$work/app/"
cp docker/Dockerfile.offline "$work/app/Dockerfile"
previous=$(docker image inspect -f '{{.Id}}' "$tag" 2>/dev/null || true)
docker build -q --build-arg "DEPS=$deps_tag" -t "$tag" "$work/app" >/dev/null
if [ -n "$previous" ] && [ "$previous" != "$(docker image inspect -f '{{.Id}}' "$tag")" ]; then
    docker rmi "$previous" >/dev/null 2>&1 || true  # the untagged image this one replaces
fi
echo "built $tag ($(docker image inspect -f '{{.Size}}' "$tag") bytes) on $deps_tag"
