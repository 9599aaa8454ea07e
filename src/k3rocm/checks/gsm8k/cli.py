"""``k3rocm gsm8k``: GSM8K 5-shot accuracy gate, lm-eval in the client container.

Exit codes (the table of k3rocm.errors): 0 pass, 1 below the gate (or a partial run that is
not allowed to pass), 2 bad input (settings, data, client image) or lm-eval error, 3 server
unreachable or no Docker engine, 130 interrupted. One line each.
"""

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


def _deployment():
    from k3rocm.deploy.deployment import load_deployment

    return load_deployment()  # a client: the checkpoint is the server's, not checked


def _resolve(args: argparse.Namespace, dep) -> tuple[str, str, str | None]:
    """URL, model name and API key: the flags, else the deployment; fills args.results_dir."""
    if args.results_dir is None:
        args.results_dir = str(dep.results_root)
    return args.url or dep.url, args.model or dep.served_model_name, dep.api_key


def deployment_view(args: argparse.Namespace) -> dict:
    """What this command resolved (``--print-deployment``)."""
    dep = _deployment()
    url, model, api_key = _resolve(args, dep)
    return {**dep.to_json(), "url": url, "served_model_name": model,
            "api_key": "***" if api_key else None,
            "results_root": str(Path(args.results_dir).absolute())}


def _check_server(url: str, model: str, explicit: bool, api_key: str | None) -> str:
    """The server answers /v1/models and serves ``model``; returns the model name to use.

    A default (not explicit) name that the server does not serve is replaced by the server's
    only model."""
    from k3rocm.deploy.server_api import ServerAPI

    served = ServerAPI(url, api_key).models()
    if model in served:
        return model
    if not explicit and len(served) == 1:
        progress(f"the server serves only {served[0]!r}; using it (--model to insist on a name)")
        return served[0]
    raise ServerError(f"model {model!r} is not served at {url} (served: "
                      f"{', '.join(served) or 'none'}); pass --model")


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
    dep = _deployment()
    url, model_name, api_key = _resolve(args, dep)
    # Everything checkable without a server, before anything expensive.
    s = Gsm8kSettings.from_args(args, url=url, model=model_name)
    argv = command.lm_eval_argv(s)
    if args.dry_run:
        try:
            where = data.resolve(args.data_dir, args.hf_home, dep.cache_dir).describe()
        except data.NoDataError as exc:  # the command does not depend on the data source
            where = f"none yet ({exc})"
        print(shlex.join(argv))
        print(f"# in {s.client_image}, --network host, run dir mounted at {command.OUT_MOUNT}, "
              f"task {data.TASK_FILE} as {command.TASKS_MOUNT}/gsm8k.yaml, data: {where}",
              file=sys.stderr)
        return 0
    src = data.resolve(args.data_dir, args.hf_home, dep.cache_dir)

    s = Gsm8kSettings.from_args(args, url=url, model=_check_server(
        url, s.model, explicit=args.model is not None, api_key=api_key))
    argv = command.lm_eval_argv(s)
    client = docker_client()
    image_id(client, s.client_image)
    return execute(client, s, src, argv, api_key, args.results_dir, args.server_container, dep)


HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")


def _fetch_data(args: argparse.Namespace) -> int:
    """``make gsm8k-data``: openai/gsm8k into the HF hub cache, once, with huggingface_hub in the
    client image (the parquet snapshot that :func:`data.resolve` then finds offline)."""
    home = Path(args.hf_home or data.hf_home_candidates(None, _deployment().cache_dir)[0]
                ).expanduser().resolve()
    with contextlib.suppress(data.NoDataError):
        src = data.resolve(None, str(home))
        print(f"gsm8k-data: already there: {src.describe()}", file=sys.stderr)
        return 0
    client = docker_client()
    image_id(client, args.client_image)
    home.mkdir(parents=True, exist_ok=True)
    env = {"HF_HOME": "/hf", "HF_HUB_DISABLE_TELEMETRY": "1"}  # run_client sets HOME=/tmp
    # a mirror or a token, as on the host
    env.update({k: os.environ[k] for k in ("HF_ENDPOINT", "HF_TOKEN") if os.environ.get(k)})
    mounts = {str(home): ("/hf", "rw"),
              str(LAUNCHER_SRC): (f"/k3/{command.LAUNCHER_NAME}", "ro")}
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
