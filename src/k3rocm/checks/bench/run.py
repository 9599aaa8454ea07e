"""One bench run: check the server, run aiperf in the client container (host network, run dir
and tokenizer mounted at their host paths, as the calling user), write the run directory
(artifacts, summary.json, perf.csv, report.md, PNG plots, provenance.json). HF_HUB_OFFLINE /
TRANSFORMERS_OFFLINE stay unset: aiperf 0.13.0 cannot load a local tokenizer with either set.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3rocm.checks.bench import plots, summary
from k3rocm.checks.bench.workloads import Workload, aiperf_command, shell_line
from k3rocm.deploy import runrecord
from k3rocm.deploy.engine import docker_client, image_id, run_client
from k3rocm.deploy.provenance import served_as
from k3rocm.deploy.scale.status import topology
from k3rocm.deploy.server_api import wait_ready
from k3rocm.errors import EXIT_CHECK_FAILED, EXIT_INTERRUPTED, EXIT_OK, UsageError, tagged_log
from k3rocm.rundir import create_run_dir, write_json_atomic, write_text_atomic
from k3rocm.serving.config import redact_argv

AIPERF_VERSION = "0.13.0"
LABEL = "k3rocm.bench"
# A host path is mounted at the same path in the client unless it would shadow these.
_SYSTEM_PREFIXES = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/opt/clients",
                    "/proc", "/sbin", "/sys", "/usr")
_SYSTEM_DIRS = ("/", "/tmp", "/root", "/run", "/var", "/opt", "/home", "/mnt")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tiktoken.model",
                    "tokenizer.model", "vocab.json")
_log = tagged_log("bench")


def check_tokenizer(path: str) -> Path:
    if not path:
        raise UsageError("no tokenizer: K3_MODEL is not a checkpoint directory on this host; "
                         "pass the model's local directory with --tokenizer DIR")
    p = Path(path).expanduser()
    if not p.is_dir():
        raise UsageError(f"tokenizer directory {path!r} does not exist: pass the model's local "
                         f"directory with --tokenizer DIR (or BENCH_TOKENIZER)")
    if not any((p / f).exists() for f in _TOKENIZER_FILES):
        raise UsageError(f"{path!r} holds no tokenizer ({', '.join(_TOKENIZER_FILES)}): pass the "
                         f"model's local directory with --tokenizer DIR")
    return p.resolve()


def container_path(host: str | os.PathLike) -> str:
    """Where a host path is mounted in the client."""
    p = str(Path(host).resolve())
    if p in _SYSTEM_DIRS or any(p == s or p.startswith(s + "/") for s in _SYSTEM_PREFIXES):
        return "/mnt/k3bench" + p
    return p


def client_aiperf_version(client, image: str) -> str | None:
    try:
        out = client.containers.run(image, ["aiperf", "--version"], remove=True,
                                    network_mode="none", labels={LABEL: "client-version"})
        return out.decode().strip().splitlines()[-1]
    except Exception:  # noqa: BLE001
        return None


def planned_command(w: Workload, run_dir: Path) -> list[str]:
    tok = container_path(Path(w.tokenizer).expanduser()) if w.tokenizer else w.tokenizer
    return aiperf_command(w, container_path(run_dir) + "/aiperf", tokenizer=tok)


@dataclass
class BenchResult:
    status: str  # ok | failed | interrupted
    exit_code: int
    message: str
    summary: dict = field(default_factory=dict)  # summary.json


def run_bench(w: Workload, *, results: Path, client_image: str, server_timeout: float,
              label: str | None = None, progress: bool = True, tp: Any = None,
              server_container=None, docker=None, extra_provenance: dict | None = None,
              run_dir: Path | None = None, deployment: Any = None) -> BenchResult:
    """Run one workload against a running server; always writes a complete run dir."""
    tok = check_tokenizer(w.tokenizer)
    client = docker or docker_client()
    client_id = image_id(client, client_image)
    wait_ready(w.url, w.model, server_timeout, api_key=w.api_key)
    run_dir = run_dir or create_run_dir(results, label or w.name)
    _log(f"run directory {run_dir}")
    argv = planned_command(w, run_dir)
    shown = redact_argv(argv, [w.api_key])
    cmd_line = shell_line(shown)
    write_text_atomic(run_dir / "command.txt", cmd_line + "\n")
    write_json_atomic(run_dir / "workload.json", w.model_dump(mode="json"))
    aiperf_version = client_aiperf_version(client, client_image)
    prov = runrecord.build(
        deployment=deployment, url=w.url, measure="bench", workload=w.name,
        topology=topology(w.url),
        server=runrecord.server(client, w.url, w.api_key, container=server_container),
        tools={"aiperf": aiperf_version, "client_image": client_image,
               "client_image_id": client_id},
        client={"image": client_image, "image_id": client_id, "aiperf_version": aiperf_version,
                "aiperf_pinned": AIPERF_VERSION, "command": shown, "command_line": cmd_line,
                "env_note": "HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE deliberately unset"},
        **(extra_provenance or {}))
    runrecord.write(run_dir, prov)

    _log(f"aiperf: {cmd_line}")
    t0 = time.time()
    res = run_client(client, client_image, argv,
                     {str(run_dir): (container_path(run_dir), "rw"),
                      str(tok): (container_path(tok), "ro")},
                     run_dir / "aiperf.log",
                     f"k3bench-aiperf-{run_dir.name}".replace(":", "")[:120],
                     progress=progress, labels={LABEL: "client"}, tool="aiperf", tag="bench")
    server, served = prov["server"], served_as(prov["server"])
    points = summary.summarize(run_dir / "aiperf", w.points(), *summary.tokens_per_step(server),
                               expect={"isl": w.isl, "osl": w.osl,
                                       "prefix_caching": w.prefix_caching})
    caching, caching_from = served_prefix_caching(server)
    caching_note = None
    if w.prefix_caching is not None and caching != w.prefix_caching:
        caching_note = (f"the workload needs prefix caching {_onoff(w.prefix_caching)}, the "
                        f"server ran with it {_onoff(caching)} (serve with K3_PREFIX_CACHING="
                        f"{int(w.prefix_caching)})")
        _log(f"WARNING: {caching_note}")
    bunched = [p for p in points if (p.get("stream") or {}).get("bunched")]
    for p in points:
        for f in ([p["stream"]["note"]] if p in bunched else []) + (p.get("flags") or []):
            _log(f"WARNING c={p['concurrency']}: {f}")
    failed = [p for p in points if p["status"] != "ok"]
    status = ("interrupted" if res.interrupted
              else "failed" if failed or res.exit_code != 0 else "ok")
    server_alive = True
    if status != "ok":
        try:
            wait_ready(w.url, w.model, 0, api_key=w.api_key, quiet=True)
        except UsageError:
            server_alive = False
    doc = {
        "status": status, "workload": w.name, "run_dir": str(run_dir),
        "aiperf_exit_code": res.exit_code, "aiperf_seconds": round(res.seconds, 1),
        "wall_seconds": round(time.time() - t0, 1), "server_reachable_after": server_alive,
        "protocol": w.protocol(), "command": cmd_line, "points": points,
        "prefix_caching": {"workload": w.prefix_caching, "server": caching,
                           "server_from": caching_from, "note": caching_note},
        "served_config": (server or {}).get("served_config"),
        "server_settings_from": served.source}
    write_json_atomic(run_dir / "summary.json", doc)
    write_text_atomic(run_dir / "perf.csv", summary.perf_csv(
        points, model=w.model, benchmark=w.name, tp=served.tp if tp is None else tp, inp=w.isl,
        out=w.osl, cmd=cmd_line))
    want = "any" if w.prefix_caching is None else _onoff(w.prefix_caching)
    write_text_atomic(run_dir / "report.md", summary.markdown_report(
        points, f"{w.name} ({status})", [
            f"workload `{w.name}`: {w.description}",
            f"ISL {w.isl} (stddev {w.isl_stddev}), OSL {w.osl} (stddev {w.osl_stddev}), shared "
            f"prefix {w.shared_prefix_tokens} tokens, extra inputs "
            f"{', '.join(w.extra_inputs) or 'none'}",
            f"{w.warmup_request_count} warmup requests per point; sweep {w.sweep_type} over "
            f"concurrency {list(w.concurrency)} with request counts {list(w.request_count)}; "
            f"seed {w.random_seed}; endpoint {w.endpoint_type}, streaming {w.streaming}, server "
            f"token counts {w.use_server_token_count}",
            f"command: `{cmd_line}`", f"server: {_server_line(server)}",
            f"prefix caching: workload {want}, server {_onoff(caching)} ({caching_from})"
            + (f" - **{caching_note}**" if caching_note else ""),
            f"graphs: {graphs_line(server)}",
            f"upstream figures: {prov['upstream_comparison']['text']}"]))
    if not plots.write_plots(points, run_dir, w.name):
        _log("matplotlib is not installed: no PNG plots (pip install 'k3rocm[host]')")

    n_ok, n = len(points) - len(failed), len(points)
    if status == "ok":
        at = ", ".join(f"c={p['concurrency']}" for p in bunched)
        note = f" ({summary.BUNCHED_NOTE} at {at})" if bunched else ""
        msg, code = f"bench {w.name}: {n_ok} of {n} points ok{note}; results in {run_dir}", EXIT_OK
    elif status == "interrupted":
        msg = f"bench {w.name}: interrupted; {n_ok} of {n} points finished and kept in {run_dir}"
        code = EXIT_INTERRUPTED
    else:
        first = failed[0] if failed else None
        why = (f"c={first['concurrency']}: {first['reason']}" if first
               else f"aiperf exited with {res.exit_code}")
        if res.exit_code not in (0, None) and (not first or first["reason"].startswith("not run")):
            why = f"aiperf exited with {res.exit_code}: {_last_error(res.log_path)}"
        down = "" if server_alive else "; the server is no longer reachable"
        msg = (f"bench {w.name}: {len(failed)} of {n} points failed ({why}){down}; raw logs and "
               f"finished points kept in {run_dir}")
        code = EXIT_CHECK_FAILED
    return BenchResult(status, code, " ".join(msg.split()), doc)


def served_prefix_caching(prov: dict | None) -> tuple[bool | None, str]:
    """(prefix caching, where it was read): the server's own report (log or /metrics; vLLM
    turns it off itself, e.g. MLA on a non-GPU platform), else the argv (vLLM default on)."""
    said = ((prov or {}).get("served_config") or {}).get("prefix_caching") or {}
    if said.get("value") is not None:
        return said["value"], f"the server's own report ({said.get('from')})"
    argv = served_as(prov).argv
    if not argv:
        return None, "unknown"
    return ("--no-enable-prefix-caching" not in argv,
            "asked in the argv only (the server's log and metrics said nothing)")


def server_prefix_caching(prov: dict | None) -> bool | None:
    return served_prefix_caching(prov)[0]


def graphs_line(prov: dict | None) -> str:
    """Graph mode as the server's log reported it (provenance.served_config)."""
    g = ((prov or {}).get("served_config") or {}).get("graphs") or {}
    if g.get("enforce_eager") is None and g.get("cudagraph_mode") is None:
        return "unknown (no engine config line in the server's log)"
    cap = f"captured in {g['capture_seconds']} s" if g.get("captured") else "none captured"
    return (f"cudagraph_mode {g.get('cudagraph_mode')}, enforce_eager {g.get('enforce_eager')}, "
            f"{cap} (the server's log)")


def _onoff(v: bool | None) -> str:
    return {True: "on", False: "off", None: "unknown"}[v]


def _last_error(log: Path) -> str:
    """The most telling line of aiperf's output (an error line, else the last line)."""
    try:
        lines = [s for ln in log.read_text(errors="replace").splitlines()
                 if (s := ln.strip().strip("│╭╮╰╯─ ").strip())]
    except OSError:
        return "no log"
    errs = [ln for ln in lines if any(w in ln for w in ("Error", "error:", "ERROR", "Invalid",
                                                         "invalid", "Unknown"))]
    return (errs or lines or ["no output"])[-1][:240]


def _server_line(prov: dict) -> str:
    c = (prov or {}).get("container") or {}
    return (f"vLLM {prov.get('vllm_version')}, image {c.get('image_ref')} ({c.get('image_id')}), "
            f"fusions {json.dumps(prov.get('fusion_toggles'))}, settings from "
            f"{served_as(prov).source}" if c else
            f"vLLM {prov.get('vllm_version')} (no local container found)")
