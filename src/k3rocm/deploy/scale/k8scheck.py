"""``make k8s-check``: the rendered manifests against the strict schemas of Kubernetes 1.29 ..
1.37 (kubernetes-validate, offline) and, with a kubeconfig and ``kubectl``, ``kubectl apply
--dry-run=server --validate=strict`` against that cluster (its schemas, webhooks, Pod Security
admission; nothing persisted). Exit 0 ok, 1 a check failed, 2 bad settings, 3 no answer.
:func:`cluster_nodes` (``make preflight``, ``make status``): the nodes the server pod may use.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from k3rocm.errors import ServerError, UsageError

K8S_MINORS = range(29, 38)  # kubernetes-validate 1.37.0 bundles 1.25 .. 1.37
KUBECTL_TIMEOUT_S = 60
DRY_RUN = ("apply", "--dry-run=server", "--validate=strict",
           f"--request-timeout={KUBECTL_TIMEOUT_S}s", "-f", "-")


def schema_lines(objs: list[dict[str, Any]]) -> tuple[list[str], bool]:
    from k3rocm.deploy.scale.k8s import validate

    ok, lines = [], []
    for minor in K8S_MINORS:
        try:
            validate(objs, f"1.{minor}.0")
            ok.append(minor)
        except UsageError as exc:
            if "not installed" in str(exc):
                raise
            lines.append(f"FAIL {exc}")
    if ok:
        lines.insert(0, f"ok   {len(objs)} objects against the strict schemas of Kubernetes "
                        + ", ".join(f"1.{m}" for m in ok))
    return lines, len(ok) != len(K8S_MINORS)


def kubeconfig(environ: Mapping[str, str] | None = None) -> tuple[str | None, str]:
    """(KUBECONFIG value to use, or None; why not). Same lookup as kubectl."""
    env = os.environ if environ is None else environ
    listed = [p for p in (env.get("KUBECONFIG") or "").split(os.pathsep) if p]
    paths = listed or [str(Path(env.get("HOME") or Path.home()) / ".kube" / "config")]
    found = [p for p in paths if Path(p).is_file()]
    if not found:
        return None, (f"no kubeconfig (KUBECONFIG={':'.join(listed)}: no such file)" if listed
                      else f"no kubeconfig (KUBECONFIG unset, no {paths[0]})")
    if not shutil.which("kubectl", path=env.get("PATH")):
        return None, "kubectl is not on PATH"
    return os.pathsep.join(found), ""


def kubectl(kc: str, *args: str, stdin: str | None = None,
            environ: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**(os.environ if environ is None else environ), "KUBECONFIG": kc}
    try:
        return subprocess.run(["kubectl", *args], input=stdin, env=env, capture_output=True,
                              text=True, timeout=KUBECTL_TIMEOUT_S + 30)
    except subprocess.TimeoutExpired:
        raise ServerError(f"kubectl {args[0]} got no answer in {KUBECTL_TIMEOUT_S + 30} s from "
                          f"the cluster in {kc}") from None


def _last_line(r: subprocess.CompletedProcess) -> str:
    return (r.stderr.strip().splitlines() or [f"kubectl exit {r.returncode}"])[-1]


def _term_matches(term: Mapping[str, Any], node: Mapping[str, Any]) -> bool:
    labels = node["metadata"].get("labels") or {}
    fields = {"metadata.name": node["metadata"]["name"]}
    for src, exprs in ((labels, term.get("matchExpressions")), (fields, term.get("matchFields"))):
        for e in exprs or []:
            v, op, vals = src.get(e["key"]), e["operator"], e.get("values") or []
            ok = {"In": v in vals, "NotIn": v not in vals, "Exists": v is not None,
                  "DoesNotExist": v is None}.get(op)
            if op in ("Gt", "Lt"):
                try:
                    ok = (int(v) > int(vals[0])) if op == "Gt" else (int(v) < int(vals[0]))
                except (TypeError, ValueError):
                    ok = False
            if not ok:
                return False
    return True


def node_matches(spec: Mapping[str, Any], node: Mapping[str, Any]) -> bool:
    """Does the pod's nodeSelector and required nodeAffinity admit ``node``?"""
    labels = node["metadata"].get("labels") or {}
    if any(labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()):
        return False
    req = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution")
    return req is None or any(_term_matches(t, node) for t in req.get("nodeSelectorTerms") or [])


def server_pod(objs: list[dict[str, Any]]) -> dict[str, Any]:
    """The rendered server Deployment's pod spec."""
    from k3rocm.deploy.scale.k8s import APP

    return next(o["spec"]["template"]["spec"] for o in objs
                if o["kind"] == "Deployment" and o["metadata"]["name"] == APP)


def node_selection(objs: list[dict[str, Any]], environ: Mapping[str, str] | None = None
                   ) -> tuple[str, str]:
    """(ok | fail | skip, what was found): the cluster's nodes the server pod may run on."""
    kc, why = kubeconfig(environ)
    if kc is None:
        return "skip", f"skipped: {why}"
    r = kubectl(kc, "get", "nodes", "-o", "json", "--request-timeout=15s", environ=environ)
    if r.returncode != 0:
        return "fail", "kubectl get nodes: " + _last_line(r)
    spec = server_pod(objs)
    nodes = json.loads(r.stdout).get("items") or []
    hits = [node_matches(spec, n) for n in nodes]
    parts = [f"{n['metadata']['name']} {'matches' if hit else 'no'} " + json.dumps(
        {k: v for k, v in (n["metadata"].get("labels") or {}).items()
         if k.startswith("amd.com/gpu")}, sort_keys=True)
        for n, hit in zip(nodes, hits, strict=True)]
    return ("ok" if any(hits) else "fail",
            f"{sum(hits)} of {len(nodes)} nodes match the server pod's node selection: "
            + "; ".join(parts))


def k8s_check(objs: list[dict[str, Any]], manifests: str,
              environ: Mapping[str, str] | None = None, out: Callable[[str], None] = print
              ) -> int:
    """Every check on the rendered ``objs`` (``manifests``: the same as YAML); the exit code."""
    kc, why = kubeconfig(environ)
    if kc is not None:  # exit 3 in one line, before anything is printed
        r = kubectl(kc, "get", "--raw", "/version", "--request-timeout=10s", environ=environ)
        if r.returncode != 0:
            raise ServerError(f"the cluster in KUBECONFIG={kc} does not answer: {_last_line(r)}"
                              " (check `kubectl cluster-info`, or unset KUBECONFIG for the "
                              "offline checks)")
    lines, failed = schema_lines(objs)
    lines = ["strict schemas (kubernetes-validate, offline):", *(f"  {ln}" for ln in lines)]
    if kc is None:
        lines.append(f"cluster: {why}: offline checks only")
    else:
        r = kubectl(kc, *DRY_RUN, stdin=manifests, environ=environ)
        lines.append(f"cluster (KUBECONFIG={kc}): kubectl {' '.join(DRY_RUN)}")
        lines += [f"  ok   {ln}" for ln in r.stdout.splitlines() if ln.strip()]
        lines += [f"  {'warn' if ln.startswith('Warning:') else 'FAIL'} {ln}"
                  for ln in r.stderr.splitlines() if ln.strip()]
        if r.returncode != 0 and not r.stderr.strip():
            lines.append(f"  FAIL kubectl exit {r.returncode}")
        failed |= r.returncode != 0
    for ln in lines:
        out(ln)
    out("k8s-check: " + ("FAILED" if failed else "ok"))
    return 1 if failed else 0


def cluster_nodes(scale, dotenv: str | os.PathLike | None = ".env",
                  environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """:func:`node_selection` for the current settings; skipped without a kubeconfig or when
    the manifests do not render."""
    kc, why = kubeconfig(environ)
    if kc is None:
        return "skip", f"skipped: {why}"
    from k3rocm.deploy.scale.k8s import render_k8s
    from k3rocm.deploy.scale.render import plan
    from k3rocm.serving.config import load_settings

    try:
        settings, _ = load_settings(environ, dotenv, check_model=False)
        objs = render_k8s(plan(environ, dotenv, scale=scale), settings)
    except UsageError as exc:
        return "skip", f"skipped: the manifests do not render ({exc})"
    return node_selection(objs, environ)
