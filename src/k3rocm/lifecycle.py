"""``k3rocm wait`` and ``k3rocm save-log``: the compose server's readiness and its log.

Both talk to the server compose started (``docker compose`` with the files in
``COMPOSE_FILE``, which the Makefile sets: ``compose.yaml`` plus ``compose.cpu.yaml`` with
``CPU=1``), with the settings every command reads (shell > .env > profile > default).

- ``wait``: until ``/health`` answers and ``/v1/models`` serves the model, printing elapsed
  time, the container state and the server's last log line; fails (exit 3) with the reason and
  the last log lines when the container stops or the timeout passes. ``make up`` ends with it.
- ``save-log``: the server's whole log into a new run directory under the results root
  (``make down`` does this before removing the container, so the log outlives it).
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from k3rocm.errors import UsageError


def _compose(*args: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["docker", "compose", *args], capture_output=True, text=True,
                              timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UsageError(f"docker compose {' '.join(args)} failed ({exc})", 3) from None


def _state() -> str | None:
    p = _compose("ps", "-a", "--format", "{{.State}}", "server")
    return p.stdout.strip().splitlines()[-1] if p.returncode == 0 and p.stdout.strip() else None


def _tail(n: int) -> str:
    p = _compose("logs", "--no-color", "--no-log-prefix", "--tail", str(n), "server")
    return (p.stdout + p.stderr).rstrip()


def _last_line() -> str:
    lines = [ln for ln in _tail(5).splitlines() if ln.strip()]
    return f"{_state() or '?'}: {lines[-1][:160] if lines else '(no log yet)'}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="what", metavar="{wait,save-log}")
    w = sub.add_parser("wait", help="wait until the compose server is ready",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    w.add_argument("--timeout", type=float, default=None,
                   help="seconds (default: the engine's VLLM_ENGINE_READY_TIMEOUT_S + 10 min, "
                   "or 15 min)")
    w.add_argument("--env-file", default=".env")
    s = sub.add_parser("save-log", help="save the compose server's log into a run directory")
    s.add_argument("--env-file", default=".env")
    s.add_argument("--label", default="server-log")


def run(args: argparse.Namespace) -> int:
    from k3rocm.config import render

    rendered = render(dotenv=args.env_file, host_paths=True, check_model=False)
    st = rendered.settings
    if args.what == "wait":
        from k3rocm.readiness import wait_ready

        timeout = args.timeout
        if timeout is None:
            engine = rendered.env.get("VLLM_ENGINE_READY_TIMEOUT_S")
            timeout = float(engine) + 600 if engine else 900.0
        if timeout <= 0:
            raise UsageError(f"--timeout {timeout:g} must be > 0", 2)
        if _state() is None:
            raise UsageError("no server container: start it with `make up` "
                             "(or `docker compose up -d server`)", 3)
        url = f"http://127.0.0.1:{st.port}"
        try:
            wait_ready(url, st.served_model_name, timeout, st.api_key, is_alive=_state,
                       status=_last_line, every=10)
        except UsageError as exc:
            print(f"k3rocm: last server log lines:\n{_tail(25)}", file=sys.stderr)
            raise UsageError(str(exc), exc.exit_code) from None
        return 0
    if args.what == "save-log":
        from k3rocm.rundir import create_run_dir, write_text_atomic

        p = _compose("logs", "--no-color", "--timestamps", "server")
        if p.returncode != 0 or not (p.stdout + p.stderr).strip():
            print("k3rocm: no server log to save (no server container)", file=sys.stderr)
            return 0
        out = create_run_dir(st.results_dir, args.label)
        write_text_atomic(out / "server.log", p.stdout + p.stderr)
        print(f"k3rocm: server log saved to {out / 'server.log'}", file=sys.stderr)
        return 0
    raise UsageError("server needs a subcommand: wait or save-log (see k3rocm server --help)")
