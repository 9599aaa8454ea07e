"""``k3rocm gsm8k``, one flow: the flags (each on one typed field), what they resolve to from the
deployment, the data, lm-eval in the client container (:func:`execute`, also each arm of
``ab --measure gsm8k``) and the verdict (:mod:`.results`); ``--rescore``, ``--fetch-data`` and
``--dry-run`` stop early. docs/gsm8k.md."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Literal
from urllib.parse import urlparse

from pydantic import field_validator, model_validator

from k3rocm.checks.gsm8k import data, results
from k3rocm.checks.gsm8k.results import FALLBACK_CHAT_MODEL, NUM_FEWSHOT
from k3rocm.deploy import runrecord
from k3rocm.deploy.engine import CLIENT_IMAGE, docker_client, image_id, run_client
from k3rocm.deploy.scale.status import topology
from k3rocm.errors import EXIT_INTERRUPTED, ServerError, UsageError, tagged_log
from k3rocm.hashing import sha256_file
from k3rocm.options import Options, ServerFlags, like, option
from k3rocm.rundir import create_run_dir, write_bytes_atomic, write_json_atomic, write_text_atomic
from k3rocm.serving.config import REDACTED, redact_env

CLIENT_PYTHON = "/opt/clients/bin/python"
OUT_MOUNT = "/out"
TASKS_MOUNT = f"{OUT_MOUNT}/tasks"  # <run>/tasks/gsm8k.yaml
LAUNCHER_SRC = Path(__file__).with_name("lmeval_launch.py")
LAUNCHER_NAME = "k3rocm_lmeval.py"  # copied into <run>/lmeval_plugin/
CHAT_MODEL = "local-chat-completions"  # lm-eval's own, as vLLM PR #52494 ran
COMPLETIONS_MODEL = "local-completions"
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
EVAL, IO = "evaluation", "data and output"  # --help groups
progress = tagged_log("gsm8k")


class Gsm8kSettings(Options):
    """What lm-eval is run with (``url``/``model`` None until resolved from the deployment)."""

    url: str | None = like(ServerFlags, "url", group="server")
    model: str | None = like(ServerFlags, "model", "served model name (default "
                             "$K3_SERVED_MODEL_NAME, or the only model the server lists)",
                             group="server")
    mode: Literal["chat", "completions"] = option(
        "chat", "chat: /v1/chat/completions with the chat template, few-shot as turns; "
        "completions: /v1/completions with the raw 5-shot prompt", group=EVAL)
    reasoning_fallback: bool = option(
        False, "score the reasoning text when an answer's content is empty (NOT the reference "
        "protocol: counted and reported as a deviation; default off)", group=EVAL)
    concurrency: int = option(32, "requests in flight", group=EVAL, ge=1, le=1024)
    max_gen_tokens: int = option(4096, "max generated tokens per answer; reasoning models need "
                                 "many", group=EVAL, ge=1, le=262144)
    timeout: int = option(1800, "per-request timeout, seconds", group=EVAL, ge=1, le=86400,
                          unit=" seconds")
    max_retries: int = option(3, "per-request retries", group=EVAL, ge=0, le=100)
    limit: int | None = option(None, "evaluate only the first N test items (marks the run not "
                               "comparable)", group=EVAL, ge=1)
    threshold: float = option(0.94, "gate on exact_match of both strict-match and "
                              "flexible-extract", group=EVAL, gt=0, le=1)
    allow_limit: bool = option(False, "let a --limit run (or a test set other than GSM8K's 1319 "
                               "items) pass", group=EVAL)
    client_image: str = option(CLIENT_IMAGE, "image with lm-eval in /opt/clients", group=IO)
    seed: int = 1234  # fixed: not a flag

    @field_validator("url")
    @classmethod
    def _root_url(cls, v: str | None) -> str | None:
        u = urlparse(v or "")
        if v is not None and (u.scheme not in ("http", "https") or not u.hostname):
            raise ValueError("is not an http(s) URL; e.g. http://127.0.0.1:8000")
        if u.path not in ("", "/"):
            raise ValueError("has a path; give the server root (e.g. http://127.0.0.1:8000), "
                             "/v1/... is added")
        return v

    @field_validator("url", "model")
    @classmethod
    def _model_arg(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("is empty; give the served model name (K3_SERVED_MODEL_NAME)")
        if v is not None and "," in v:
            raise ValueError("contains a comma, which lm-eval's --model_args cannot carry")
        return v

    @model_validator(mode="after")
    def _fallback_needs_chat(self) -> Gsm8kSettings:
        if self.reasoning_fallback and self.mode != "chat":
            raise ValueError("--reasoning-fallback needs --mode chat (completions have no "
                             "reasoning field)")
        return self


class Gsm8kRun(Options):
    """The other ``k3rocm gsm8k`` flags: server container, data, output, modes."""

    server_container: str | None = like(ServerFlags, "server_container", group="server")
    data_dir: str | None = option(None, "directory with train.jsonl and test.jsonl (question, "
                                  "answer ending '#### N')", group=IO)
    hf_home: str | None = option(None, "HF cache holding openai/gsm8k (default $HF_HOME, "
                                 "$K3_CACHE_DIR/huggingface, ~/.cache/huggingface)", group=IO)
    results_dir: Path | None = like(ServerFlags, "results", flag="--results-dir", group=IO)
    dry_run: bool = like(ServerFlags, "dry_run", "print the exact lm_eval command line and exit "
                         "0 (no server contact; also before the data set is there)", group=IO)
    fetch_data: bool = option(False, "download openai/gsm8k once into the HF cache (--hf-home) "
                              "with the client image's huggingface_hub, then exit (needs HF hub "
                              "access; `make gsm8k-data`)", group=IO)
    rescore: str | None = option(None, "re-apply the gate to a stored run directory and print "
                                 "the verdict", group=IO, metavar="RUN_DIR")


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


def lm_eval_argv(s: Gsm8kSettings) -> list[str]:
    """The command run in the client container (lm-eval's CLI via our launcher); independent of
    the data source (that is in the run's task file)."""
    chat = s.mode == "chat"
    # max_gen_toks as a model argument (TemplateAPI's default is 256), not --gen_kwargs: the
    # task's generation_kwargs stay exactly the reference's in the config lm-eval prints.
    margs = [f"model={s.model}",
             f"base_url={s.url.rstrip('/')}/v1/{'chat/completions' if chat else 'completions'}",
             f"num_concurrent={s.concurrency}", f"max_retries={s.max_retries}",
             f"timeout={s.timeout}", f"max_gen_toks={s.max_gen_tokens}",
             "tokenized_requests=False"] + ([] if chat else ["tokenizer_backend=None"])
    model = (FALLBACK_CHAT_MODEL if s.reasoning_fallback else CHAT_MODEL) if chat \
        else COMPLETIONS_MODEL
    return [CLIENT_PYTHON, f"{OUT_MOUNT}/lmeval_plugin/{LAUNCHER_NAME}", "run",
            "--model", model, "--model_args", ",".join(margs), "--include_path", TASKS_MOUNT,
            "--tasks", "gsm8k", "--num_fewshot", str(NUM_FEWSHOT), "--batch_size", "1",
            "--seed", str(s.seed),
            *(["--apply_chat_template", "--fewshot_as_multiturn", "true"] if chat else []),
            *(["--limit", str(s.limit)] if s.limit is not None else []),
            "--output_path", f"{OUT_MOUNT}/lm_eval", "--log_samples"]


def _resolve(args: argparse.Namespace):
    """The deployment (a client: its checkpoint is not checked) and the settings from the flags
    and it; fills ``args.results_dir``."""
    dep = args.deployment
    args.results_dir = args.results_dir or str(dep.results_root)
    return dep, Gsm8kSettings.from_args(args, url=args.url or dep.url,
                                        model=args.model or dep.served_model_name)


def deployment_view(args: argparse.Namespace) -> dict:
    """What this command resolved (``--print-deployment``)."""
    dep, s = _resolve(args)
    return {"url": s.url, "served_model_name": s.model,
            "api_key": REDACTED if dep.api_key else None,
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
        try:
            where = data.resolve(args.data_dir, args.hf_home, dep.cache_dir).describe()
        except data.NoDataError as exc:  # the command does not depend on the data source
            where = f"none yet ({exc})"
        print(shlex.join(lm_eval_argv(s)))
        print(f"# in {s.client_image}, --network host, run dir mounted at {OUT_MOUNT}, "
              f"task {data.TASK_FILE} as {TASKS_MOUNT}/gsm8k.yaml, data: {where}",
              file=sys.stderr)
        return 0
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
    return execute(client, s, src, dep, create_run_dir(args.results_dir, "gsm8k"),
                   args.server_container)


def execute(client, s: Gsm8kSettings, src: data.DataSource, dep, run_dir: Path,
            server_container: str | None = None) -> int:
    """Run lm-eval into the new run directory ``run_dir`` (:func:`create_run_dir`'s) against
    the server ``dep`` describes; returns the exit code."""
    progress(f"run directory {run_dir}")
    write_bytes_atomic(run_dir / "lmeval_plugin" / LAUNCHER_NAME, LAUNCHER_SRC.read_bytes())
    write_text_atomic(run_dir / "tasks" / "gsm8k.yaml", data.task_yaml(src))
    (run_dir / "lm_eval").mkdir()
    argv = lm_eval_argv(s)
    line = shlex.join(argv)
    write_text_atomic(run_dir / "command.txt", line + "\n")
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_UPDATE_DOWNLOAD_COUNTS": "0",
           "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false",
           "K3_GSM8K_FALLBACK_LOG": f"{OUT_MOUNT}/reasoning_fallback.jsonl",
           "K3_GSM8K_CLIENT_INFO": f"{OUT_MOUNT}/client_info.json",
           "K3_GSM8K_FINISH_LOG": f"{OUT_MOUNT}/finish_reasons.jsonl"}
    if src.kind == "hf-datasets-cache":  # its arrow cache is read (and locked) in place
        env["HF_HOME"] = data.HF_MOUNT
    if dep.api_key:
        env["OPENAI_API_KEY"] = dep.api_key
    mounts = {str(run_dir.resolve()): (OUT_MOUNT, "rw"),
              str(src.host_dir): (src.mount, "rw" if src.kind == "hf-datasets-cache" else "ro")}
    img = client.images.get(s.client_image)
    image = {"ref": s.client_image, "id": img.id, "tags": img.tags,
             "labels": (img.attrs.get("Config") or {}).get("Labels") or {},
             "created": img.attrs.get("Created")}
    prov = runrecord.build(
        deployment=dep, url=s.url, topology=topology(s.url),
        server=runrecord.server(client, s.url, dep.api_key, container_name=server_container),
        tools={"lm_eval": None, "client_image": s.client_image, "client_image_id": img.id},
        client={"image": s.client_image, "image_id": img.id, "image_info": image,
                "command": argv, "command_line": line, "network_mode": "host",
                "user": f"{os.getuid()}:{os.getgid()}",
                "mounts": {h: list(m) for h, m in mounts.items()}, "env": redact_env(env)},
        # local items may not be GSM8K's own: whether the reference task ran is then unknown
        measure="gsm8k", workload={"num_fewshot": NUM_FEWSHOT, "limit": s.limit,
                                   "reference_task_config":
                                       True if src.kind != "local-jsonl" else None},
        settings=s.model_dump(), data=src.provenance(),
        task_file={"shipped": str(data.TASK_FILE), "shipped_sha256": sha256_file(data.TASK_FILE),
                   "run_copy": "tasks/gsm8k.yaml",
                   "run_copy_sha256": sha256_file(run_dir / "tasks" / "gsm8k.yaml")})
    runrecord.write(run_dir, prov)
    progress(f"server {s.url} model {s.model} (vLLM {prov['server'].get('vllm_version')}); "
             f"data {src.describe()}; lm-eval in {s.client_image}")
    progress(line)

    name = f"k3rocm-gsm8k-{run_dir.name}".replace(":", "")[:120]
    try:
        res = run_client(client, s.client_image, argv, mounts, run_dir / "lm_eval.log", name,
                         env=env, labels={"k3rocm.role": "gsm8k-client",
                                          "k3rocm.run_dir": str(run_dir)},
                         tool="lm-eval", tag="gsm8k")
    except Exception as exc:  # noqa: BLE001 - docker.errors.APIError and friends
        detail = f"could not start the client container: {exc.__class__.__name__}: {exc}"[:300]
        _finish(run_dir, s, src, prov, 0.0, "error", detail)
        raise UsageError(detail) from None
    if res.interrupted:
        summary = _finish(run_dir, s, src, prov, res.seconds, "interrupted",
                          f"Ctrl-C; lm-eval stopped, its log kept in {run_dir}")
        print(f"k3rocm: {summary['message']}", file=sys.stderr)
        return EXIT_INTERRUPTED
    if res.exit_code != 0:
        last = _first_error(run_dir / "lm_eval.log")
        _finish(run_dir, s, src, prov, res.seconds, "error", last, res.exit_code)
        raise UsageError(f"lm-eval failed (exit {res.exit_code}): {last}; log: "
                         f"{run_dir / 'lm_eval.log'}")
    summary = _finish(run_dir, s, src, prov, res.seconds)
    print(summary["message"] + f"; run dir {run_dir}", file=sys.stderr)
    return summary["exit_code"]


def _finish(run_dir: Path, s: Gsm8kSettings, src: data.DataSource, prov: dict, wall: float,
            status: str | None = None, detail: str | None = None,
            exit_status: int | None = None) -> dict:
    with contextlib.suppress(OSError, ValueError, AttributeError):  # the launcher's versions
        info = json.loads((run_dir / "client_info.json").read_text())
        prov["client"].update(info)
        prov["tools"]["lm_eval"] = (info.get("versions") or {}).get("lm_eval")
        runrecord.write(run_dir, prov)
    run = {"server_url": s.url, "model": s.model, "mode": s.mode,
           "reasoning_fallback": s.reasoning_fallback, "concurrency": s.concurrency,
           "max_gen_tokens": s.max_gen_tokens, "data": src.describe(),
           "client_image": s.client_image, "wall_seconds": round(wall, 1),
           "command": prov["client"]["command_line"], "run_dir": str(run_dir)}
    if status is None:
        try:
            summary = results.judge(run_dir, threshold=s.threshold, allow_limit=s.allow_limit,
                                    max_gen_tokens=s.max_gen_tokens)
            summary["upstream_comparison"] = prov.get("upstream_comparison")
        except UsageError as exc:
            status, detail = "error", str(exc)
    if status is not None:
        summary = {"status": status, "passed": False,
                   "exit_code": 2 if status == "error" else EXIT_INTERRUPTED,
                   "message": f"gsm8k: {status.upper()}: {detail or 'no result'}",
                   "lm_eval_exit_status": exit_status}
    summary["run"] = run
    write_json_atomic(run_dir / "summary.json", summary)
    write_text_atomic(run_dir / "summary.md", results.markdown(summary))
    return summary


def _first_error(log: Path) -> str:
    """The first error lm-eval logged (the cause), else the last error-looking line."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return "no log"
    if m := re.search(r"\bERROR[ \t]+\[[^\]\n]*\][ \t]*(.*)", text):
        return m.group(1).strip()[:300]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return next((ln for ln in reversed(lines) if any(
        k in ln for k in ("Error", "error", "Exception", "refused", "Traceback"))),
        lines[-1] if lines else "no output")[:300]


def _fetch_data(args: argparse.Namespace) -> int:
    """``make gsm8k-data``: openai/gsm8k into the HF hub cache, once, with the client image's
    huggingface_hub (the parquet snapshot :func:`data.resolve` then finds offline)."""
    home = Path(args.hf_home or data.hf_home_candidates(None, args.deployment.cache_dir)[0]
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
    mounts = {str(home): ("/hf", "rw"), str(LAUNCHER_SRC): (f"/k3/{LAUNCHER_NAME}", "ro")}
    if HOST_CA.is_file():  # a TLS-intercepting proxy's CA is often only on the host
        mounts[str(HOST_CA)] = ("/tmp/host-ca.crt", "ro")
        env.update(SSL_CERT_FILE="/tmp/host-ca.crt", REQUESTS_CA_BUNDLE="/tmp/host-ca.crt")
    endpoint = env.get("HF_ENDPOINT", "https://huggingface.co")
    progress(f"downloading openai/gsm8k (main) from {endpoint} into {home} with "
             f"{args.client_image}")
    with tempfile.TemporaryDirectory(prefix="k3rocm-gsm8k-data-") as tmp:
        log = Path(tmp) / "fetch.log"
        res = run_client(client, args.client_image,
                         [CLIENT_PYTHON, f"/k3/{LAUNCHER_NAME}", "fetch-gsm8k"],
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
