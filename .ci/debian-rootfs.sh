#!/usr/bin/env bash
# Build the Debian 12 rootfs image every locally built stand-in image starts FROM (no pulls):
# k3rocm/debian:bookworm (python3.11, pip, venv, setuptools, ca-certificates, curl, libgomp1,
# libnuma1). ~30-100 s with mmdebstrap; a no-op when the image exists.
set -euo pipefail
image=${1:-k3rocm/debian:bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
if docker image inspect "$image" >/dev/null 2>&1; then
  echo "rootfs: $image exists"; exit 0
fi
command -v mmdebstrap >/dev/null || { echo "rootfs: mmdebstrap missing (apt-get install mmdebstrap)" >&2; exit 1; }
mmdebstrap --quiet --variant=apt \
  --include=python3,python3-pip,python3-venv,python3-setuptools,ca-certificates,curl,libgomp1,libnuma1 \
  bookworm - "$mirror" | docker import - "$image"
echo "rootfs: built $image"
