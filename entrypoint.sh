#!/bin/sh
# Thin entrypoint: the Python renderer validates the K3_* settings and builds vLLM's env and argv;
# `serve` then execs `vllm serve`, so vLLM is the container's main process and gets SIGTERM.
#   entrypoint.sh [vllm serve args...]   validate, render, exec vLLM
#   entrypoint.sh --print [args...]      print {"env": ..., "argv": ...} as JSON and exit 0
set -eu
here=$(cd "$(dirname "$0")" && pwd)
# On a host checkout the package lives in ./src; inside the image it is installed.
if [ -d "$here/src/k3rocm" ]; then
  PYTHONPATH="$here/src${PYTHONPATH:+:$PYTHONPATH}"
  export PYTHONPATH
fi
py=python3
if [ "${1:-}" = "--print" ]; then
  shift
  exec "$py" -m k3rocm render -- "$@"
fi
exec "$py" -m k3rocm serve -- "$@"
