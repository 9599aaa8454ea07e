"""One gsm8k run on a ready server (``k3rocm gsm8k`` and ``ab --measure gsm8k``): the run
directory, its run record, lm-eval in the client container, the verdict."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import sys
from pathlib import Path

from k3rocm.checks.gsm8k import command, data, results
from k3rocm.checks.gsm8k.command import OUT_MOUNT, Gsm8kSettings
from k3rocm.deploy import runrecord
from k3rocm.deploy.engine import run_client
from k3rocm.deploy.scale.status import topology
from k3rocm.errors import EXIT_INTERRUPTED, UsageError, tagged_log
from k3rocm.hashing import sha256_file
from k3rocm.rundir import create_run_dir, write_bytes_atomic, write_json_atomic, write_text_atomic
from k3rocm.serving.config import redact_env

LAUNCHER_SRC = Path(__file__).with_name("lmeval_launch.py")
progress = tagged_log("gsm8k")


def execute(client, s: Gsm8kSettings, src: data.DataSource, argv: list[str],
            api_key: str | None, results_dir: str | Path, server_container: str | None = None,
            dep=None) -> int:
    """Run lm-eval into a new run directory under ``results_dir``; returns the exit code."""
    run_dir = create_run_dir(results_dir, "gsm8k")
    progress(f"run directory {run_dir}")
    write_bytes_atomic(run_dir / "lmeval_plugin" / command.LAUNCHER_NAME,
                       LAUNCHER_SRC.read_bytes())
    write_text_atomic(run_dir / "tasks" / "gsm8k.yaml", data.task_yaml(src))
    (run_dir / "lm_eval").mkdir()
    line = shlex.join(argv)
    write_text_atomic(run_dir / "command.txt", line + "\n")
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_UPDATE_DOWNLOAD_COUNTS": "0",
           "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false",
           "K3_GSM8K_FALLBACK_LOG": f"{OUT_MOUNT}/reasoning_fallback.jsonl",
           "K3_GSM8K_CLIENT_INFO": f"{OUT_MOUNT}/client_info.json",
           "K3_GSM8K_FINISH_LOG": f"{OUT_MOUNT}/finish_reasons.jsonl"}
    if src.kind == "hf-datasets-cache":  # its arrow cache is read (and locked) in place
        env["HF_HOME"] = data.HF_MOUNT
    if api_key:
        env["OPENAI_API_KEY"] = api_key
    mounts = {str(run_dir.resolve()): (OUT_MOUNT, "rw"),
              str(src.host_dir): (src.mount, "rw" if src.kind == "hf-datasets-cache" else "ro")}
    img = client.images.get(s.client_image)
    image = {"ref": s.client_image, "id": img.id, "tags": img.tags,
             "labels": (img.attrs.get("Config") or {}).get("Labels") or {},
             "created": img.attrs.get("Created")}
    prov = runrecord.build(
        deployment=dep, url=s.url, topology=topology(s.url),
        server=runrecord.server(client, s.url, api_key, container_name=server_container),
        tools={"lm_eval": None, "client_image": s.client_image, "client_image_id": img.id},
        client={"image": s.client_image, "image_id": img.id, "image_info": image,
                "command": argv, "command_line": line, "network_mode": "host",
                "user": f"{os.getuid()}:{os.getgid()}",
                "mounts": {h: list(m) for h, m in mounts.items()}, "env": redact_env(env)},
        # local items may not be GSM8K's own: whether the reference task ran is then unknown
        measure="gsm8k", workload={"num_fewshot": command.NUM_FEWSHOT, "limit": s.limit,
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
    write_text_atomic(run_dir / "summary.md", results.markdown(summary) if "metrics" in summary
                      else f"# GSM8K accuracy gate\n\n**{status.upper()}** - "
                      f"{summary['message']}\n\n```\n{run['command']}\n```\n")
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
