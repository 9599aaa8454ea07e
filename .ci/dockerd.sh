#!/usr/bin/env bash
# Start (or stop) a private Docker engine for tests and CI.
#   .ci/dockerd.sh start   -> starts dockerd in the background, waits until it answers
#   .ci/dockerd.sh stop    -> stops it by its pid file
# The socket is /run/k3d/docker.sock; export DOCKER_HOST=unix:///run/k3d/docker.sock to use it.
set -euo pipefail
root=${K3_DOCKERD_ROOT:-/var/lib/k3d}
run=/run/k3d
sock=$run/docker.sock
pidfile=$run/dockerd.pid
case "${1:-}" in
  start)
    mkdir -p "$root" "$run"
    if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
      echo "dockerd: already running (pid $(cat "$pidfile"))"; exit 0
    fi
    nohup dockerd --data-root "$root" --exec-root "$run/exec" --pidfile "$pidfile" \
      --host "unix://$sock" >"$run/dockerd.log" 2>&1 &
    for _ in $(seq 1 60); do
      if DOCKER_HOST="unix://$sock" docker info >/dev/null 2>&1; then
        echo "dockerd: ready at unix://$sock"; exit 0
      fi
      sleep 0.5
    done
    echo "dockerd: did not become ready; see $run/dockerd.log" >&2; exit 1 ;;
  stop)
    if [ -f "$pidfile" ]; then
      pid=$(cat "$pidfile"); kill "$pid" 2>/dev/null || true
      for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
      echo "dockerd: stopped"
    fi ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
