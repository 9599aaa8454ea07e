"""``k3rocm smoke``: build our image FROM the stand-in (or ``--base-image <ROCm image> --gpu``),
serve the tiny model through compose, stream one request, tear down."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from k3rocm.deploy.deployment import CPU_PROFILE
from k3rocm.deploy.lifecycle import REPO
from k3rocm.dev.standin import STANDIN_BASE
from k3rocm.dev.tinymodel import DEFAULT_NAME as SMOKE_MODEL
from k3rocm.errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-image", default=os.environ.get("BASE_IMAGE") or STANDIN_BASE,
                        help="image to build FROM (default: the CPU stand-in; a ROCm image on "
                        "an AMD node)")
    parser.add_argument("--gpu", action="store_true",
                        help="AMD node: keep the ROCm devices (no CPU override)")
    parser.add_argument("--profile", default=None,
                        help=f"K3_PROFILE for the smoke server (default {CPU_PROFILE})")
    parser.add_argument("--models-dir", type=Path, default=Path("cache/smoke-models"),
                        help="host directory that caches the generated tiny model")
    parser.add_argument("--port", type=int, default=18000, help="host port (default 18000)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens to generate")
    parser.add_argument("--timeout", type=float, default=600,
                        help="seconds to wait for the server to become healthy")
    parser.add_argument("--project", default="k3rocm-smoke", help="compose project name")
    parser.add_argument("--keep", action="store_true", help="leave the server running")
    parser.add_argument("--results", default=None,
                        help="results root: the server log goes to <root>/<UTC>-smoke/ "
                        "(default: the deployment's K3_RESULTS_DIR, shell > .env > ./results)")


def _ensure_model(image: str, models_dir: Path) -> None:
    models_dir.mkdir(parents=True, exist_ok=True)
    print(f"smoke: tiny model in {models_dir}/{SMOKE_MODEL} (generated once, then cached)",
          file=sys.stderr, flush=True)
    proc = subprocess.run(
        ["docker", "run", "--rm", "--entrypoint", "python3", "-v",
         f"{models_dir.resolve()}:/models", image, "-m", "k3rocm", "tinymodel", "--out",
         f"/models/{SMOKE_MODEL}"], text=True)
    if proc.returncode != 0:
        raise UsageError(f"generating the tiny model failed (exit {proc.returncode})", 2)


def stream_chat(base_url: str, model: str, prompt: str, max_tokens: int,
                api_key: str | None = None, echo: bool = True) -> dict:
    from k3rocm.deploy.server_api import ServerAPI

    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    st = ServerAPI(base_url, api_key).stream_chat(
        body, on_text=(lambda text: print(text, end="", flush=True)) if echo else None)
    if echo:
        print()
    if st.error:  # an HTTP error answer is exit 2; no server, or a cut stream, exit 3
        raise UsageError(f"chat completion failed: {st.error}", 3 if st.status in (None, 200)
                         else 2)
    completion = (st.usage or {}).get("completion_tokens")
    decode_s = (st.last - st.first) if st.first else None
    rate = ((completion - 1) / decode_s) if completion and decode_s else None
    return {"usage": st.usage, "ttft_s": (st.first - t0) if st.first else None,
            "decode_s": decode_s, "tokens_per_s": rate}


def run(args: argparse.Namespace) -> int:
    from k3rocm.deploy.lifecycle import ComposeServer
    from k3rocm.rundir import create_run_dir

    if not 1 <= args.port <= 65535:
        raise UsageError(f"--port {args.port} is not a port: use 1..65535")
    if args.max_tokens < 2:
        raise UsageError(f"--max-tokens {args.max_tokens} is too small: use >= 2")
    if args.timeout <= 0:
        raise UsageError(f"--timeout {args.timeout:g} must be > 0")
    image = f"k3rocm/server:smoke-{args.base_image.replace('/', '_').replace(':', '_')}"[:128]
    results = Path(args.results) if args.results else args.deployment.results_root
    env = {"BASE_IMAGE": args.base_image, "K3_IMAGE": image, "K3_PORT": str(args.port),
           "K3_MODELS_DIR": str(args.models_dir.resolve()),
           "K3_CACHE_DIR": str((REPO / "cache").resolve()),
           "K3_RESULTS_DIR": str(results.resolve()),
           "K3_PROFILE": args.profile or CPU_PROFILE,
           "K3_MODEL": f"/models/{SMOKE_MODEL}", "K3_SERVED_MODEL_NAME": SMOKE_MODEL}
    srv = ComposeServer(project=args.project, cpu=args.deployment.cpu, env=env, inherit_env=False,
                        url=f"http://127.0.0.1:{args.port}", model=SMOKE_MODEL)
    t0 = time.time()
    print(f"smoke: building {image} FROM {args.base_image}", file=sys.stderr, flush=True)
    if srv.compose("build", "server", capture=False, timeout=None).returncode != 0:
        raise UsageError(f"building {image} FROM {args.base_image} failed: see the build "
                         "output above", 3)
    build_s = time.time() - t0
    _ensure_model(image, args.models_dir)
    run_dir = create_run_dir(results, "smoke")
    interrupted = False
    old = signal.signal(signal.SIGTERM, signal.default_int_handler)  # raises KeyboardInterrupt
    try:
        srv.up(log_path=run_dir / "server.log")
        ready = srv.wait(args.timeout, every=10, quiet=True, log_path=run_dir / "server.log")
        print(f"smoke: server healthy after {ready:.0f}s", file=sys.stderr, flush=True)
        print(f"smoke: streaming {args.max_tokens} tokens from {SMOKE_MODEL}:", file=sys.stderr)
        res = stream_chat(srv.url, SMOKE_MODEL, "Say something.", args.max_tokens)
        usage = res["usage"] or {}
        print(f"smoke: build {build_s:.1f}s, ready {ready:.1f}s, "
              f"completion_tokens {usage.get('completion_tokens')}, "
              f"TTFT {res['ttft_s'] * 1000:.1f} ms, "
              f"{res['tokens_per_s']:.1f} tokens/s", file=sys.stderr)
        if usage.get("completion_tokens") != args.max_tokens:
            raise UsageError(f"asked for {args.max_tokens} tokens with ignore_eos, got "
                             f"{usage.get('completion_tokens')}", 1)
        return 0
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        signal.signal(signal.SIGTERM, old)
        if not args.keep or interrupted:
            print(f"smoke: tearing down (server log in {run_dir / 'server.log'})",
                  file=sys.stderr, flush=True)
            srv.down(log_path=run_dir / "server.log", timeout=20)
        else:
            srv.save_log(run_dir / "server.log")
