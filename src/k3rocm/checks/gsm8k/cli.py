"""``k3rocm gsm8k``: the flags, what they resolve to, and the dispatch (rescore, fetch-data,
dry run, a run: :func:`k3rocm.checks.gsm8k.run.execute`); docs/gsm8k.md."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import tempfile
from pathlib import Path

from k3rocm.checks.gsm8k import command, data, results
from k3rocm.checks.gsm8k.command import Gsm8kRun, Gsm8kSettings
from k3rocm.checks.gsm8k.run import LAUNCHER_SRC, execute, progress
from k3rocm.deploy.engine import docker_client, image_id, run_client
from k3rocm.errors import ServerError, UsageError

HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = ("Exit codes: 0 pass, 1 below the gate (or a --limit/partial run without "
                "--allow-limit), 2 bad input or lm-eval error, 3 server unreachable or no "
                "Docker engine, 130 interrupted. Task: vLLM PR #52494's gsm8k config "
                "(src/k3rocm/checks/gsm8k/gsm8k.yaml). Data: --data-dir, else the HF cache "
                "(openai/gsm8k; --fetch-data / `make gsm8k-data` puts it there). "
                "See docs/gsm8k.md.")
    groups: dict = {}
    Gsm8kSettings.add_arguments(p, groups)
    Gsm8kRun.add_arguments(p, groups)


def _resolve(args: argparse.Namespace):
    """The deployment (a client: its checkpoint is not checked) and the settings from the flags
    and it; fills ``args.results_dir``."""
    from k3rocm.deploy.deployment import load_deployment

    dep = load_deployment()
    args.results_dir = args.results_dir or str(dep.results_root)
    return dep, Gsm8kSettings.from_args(args, url=args.url or dep.url,
                                        model=args.model or dep.served_model_name)


def deployment_view(args: argparse.Namespace) -> dict:
    """What this command resolved (``--print-deployment``)."""
    dep, s = _resolve(args)
    return {**dep.to_json(), "url": s.url, "served_model_name": s.model,
            "api_key": "***" if dep.api_key else None,
            "results_root": str(Path(args.results_dir).absolute())}


def run(args: argparse.Namespace) -> int:
    if args.rescore:
        Gsm8kSettings.from_args(args)  # the flags' checks
        run_dir = Path(args.rescore)
        if not run_dir.is_dir():
            raise UsageError(f"--rescore {run_dir} is not a directory")
        verdict = results.judge(run_dir, threshold=args.threshold, allow_limit=args.allow_limit,
                                max_gen_tokens=(results.read_summary(run_dir).get("run") or {})
                                .get("max_gen_tokens"))
        print(json.dumps(verdict, indent=2))
        print(verdict["message"], file=sys.stderr)
        return verdict["exit_code"]
    if args.fetch_data:
        return _fetch_data(args)
    dep, s = _resolve(args)  # everything checkable without a server, before anything else
    if args.dry_run:
        argv = command.lm_eval_argv(s)
        try:
            where = data.resolve(args.data_dir, args.hf_home, dep.cache_dir).describe()
        except data.NoDataError as exc:  # the command does not depend on the data source
            where = f"none yet ({exc})"
        print(shlex.join(argv))
        print(f"# in {s.client_image}, --network host, run dir mounted at {command.OUT_MOUNT}, "
              f"task {data.TASK_FILE} as {command.TASKS_MOUNT}/gsm8k.yaml, data: {where}",
              file=sys.stderr)
        return 0
    command.lm_eval_argv(s)  # its checks, before the data
    src = data.resolve(args.data_dir, args.hf_home, dep.cache_dir)
    from k3rocm.deploy.server_api import ServerAPI

    served = ServerAPI(s.url, dep.api_key).models()
    if s.model not in served:  # a default name the server does not serve: its only model
        if args.model is not None or len(served) != 1:
            raise ServerError(f"model {s.model!r} is not served at {s.url} (served: "
                              f"{', '.join(served) or 'none'}); pass --model")
        progress(f"the server serves only {served[0]!r}; using it (--model to insist on a name)")
        s = Gsm8kSettings.from_args(args, url=s.url, model=served[0])
    client = docker_client()
    image_id(client, s.client_image)
    return execute(client, s, src, command.lm_eval_argv(s), dep.api_key, args.results_dir,
                   args.server_container, dep)


def _fetch_data(args: argparse.Namespace) -> int:
    """``make gsm8k-data``: openai/gsm8k into the HF hub cache, once, with the client image's
    huggingface_hub (the parquet snapshot :func:`data.resolve` then finds offline)."""
    from k3rocm.deploy.deployment import load_deployment

    home = Path(args.hf_home or data.hf_home_candidates(None, load_deployment().cache_dir)[0]
                ).expanduser().resolve()
    with contextlib.suppress(data.NoDataError):
        src = data.resolve(None, str(home))
        print(f"gsm8k-data: already there: {src.describe()}", file=sys.stderr)
        return 0
    client = docker_client()
    image_id(client, args.client_image)
    home.mkdir(parents=True, exist_ok=True)
    env = {"HF_HOME": "/hf", "HF_HUB_DISABLE_TELEMETRY": "1",
           **{k: os.environ[k] for k in ("HF_ENDPOINT", "HF_TOKEN") if os.environ.get(k)}}
    mounts = {str(home): ("/hf", "rw"), str(LAUNCHER_SRC): (f"/k3/{command.LAUNCHER_NAME}", "ro")}
    if HOST_CA.is_file():  # a TLS-intercepting proxy's CA is often only on the host
        mounts[str(HOST_CA)] = ("/tmp/host-ca.crt", "ro")
        env.update(SSL_CERT_FILE="/tmp/host-ca.crt", REQUESTS_CA_BUNDLE="/tmp/host-ca.crt")
    endpoint = env.get("HF_ENDPOINT", "https://huggingface.co")
    progress(f"downloading openai/gsm8k (main) from {endpoint} into {home} with "
             f"{args.client_image}")
    with tempfile.TemporaryDirectory(prefix="k3rocm-gsm8k-data-") as tmp:
        log = Path(tmp) / "fetch.log"
        res = run_client(client, args.client_image,
                         [command.CLIENT_PYTHON, f"/k3/{command.LAUNCHER_NAME}", "fetch-gsm8k"],
                         mounts, log, f"k3rocm-gsm8k-data-{os.getpid()}", progress=False,
                         env=env, labels={"k3rocm.role": "gsm8k-data"}, tool="the download",
                         tag="gsm8k-data")
        out = log.read_text(errors="replace").strip().splitlines()
    if res.interrupted:
        raise KeyboardInterrupt
    info = {"error": (out[-1] if out else "no output")[:300]}
    for line in reversed(out):  # the launcher's one JSON line (stderr is in the log too)
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                info = json.loads(line)
                break
    if res.exit_code != 0 or "error" in info:
        raise UsageError(f"gsm8k-data: could not download openai/gsm8k from {endpoint} "
                         f"({info.get('error', f'exit {res.exit_code}')}); without hub access "
                         "copy a filled HF cache here or use --data-dir (docs/gsm8k.md)")
    src = data.resolve(None, str(home))
    print(f"gsm8k-data: openai/gsm8k revision {info.get('revision')} in {src.describe()}",
          file=sys.stderr)
    return 0
