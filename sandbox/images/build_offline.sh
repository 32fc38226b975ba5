#!/usr/bin/env bash
# Build the sandbox base image on a machine without an image registry (CI, air-gapped hosts):
# debootstrap a minimal Debian with python3, then `docker import` the root file system.
# Real deployments build sandbox/images/Dockerfile from a public base image instead.
#
#   sandbox/images/build_offline.sh [TAG]        (default streamrl-sandbox:offline)
#
# Idempotent: does nothing when TAG already exists (FORCE=1 rebuilds). Needs root, debootstrap
# and a reachable Debian mirror (MIRROR, default deb.debian.org). About 30-60 s.
set -euo pipefail
tag=${1:-streamrl-sandbox:offline}
suite=${SUITE:-bookworm}
mirror=${MIRROR:-http://deb.debian.org/debian}

if [ "${FORCE:-0}" != 1 ] && docker image inspect "$tag" >/dev/null 2>&1; then
    echo "image $tag already present"
    exit 0
fi
command -v debootstrap >/dev/null || { echo "debootstrap is not installed" >&2; exit 1; }

rootfs=$(mktemp -d /var/tmp/streamrl-rootfs.XXXXXX)
trap 'rm -rf "$rootfs"' EXIT
debootstrap --variant=minbase --include=python3 "$suite" "$rootfs" "$mirror" >"$rootfs.log" 2>&1 \
    || { tail -20 "$rootfs.log" >&2; exit 1; }
rm -f "$rootfs.log"
# Trim what a sandbox never needs; add the mount point of the work dir (a tmpfs at run time).
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
    "$rootfs"/usr/share/doc "$rootfs"/usr/share/man "$rootfs"/usr/share/locale
mkdir -p "$rootfs/work"
tar --numeric-owner -C "$rootfs" -c . | docker import \
    --change 'ENV PATH=/usr/local/bin:/usr/bin:/bin LANG=C.UTF-8' \
    --change 'USER 65534:65534' \
    --change 'WORKDIR /work' \
    --change 'CMD ["python3"]' \
    - "$tag" >/dev/null
echo "built $tag ($(docker image inspect -f '{{.Size}}' "$tag") bytes)"
