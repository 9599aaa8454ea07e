"""``make k8s-check``: the rendered manifests checked as a cluster would (issue 30 item 6).

With a usable kubeconfig (``KUBECONFIG`` or ``~/.kube/config``, and ``kubectl`` on PATH) the
rendering goes to that cluster as ``kubectl apply --dry-run=server --validate=strict -f -``:
the API server's own schema, strict field validation, defaulting, admission webhooks and Pod
Security admission, nothing persisted. Here (and in CI) no cluster runs, so the offline checks
are the strongest we can do:

* strict schemas: every object against the strict Kubernetes schemas of 1.29 .. 1.37 that
  kubernetes-validate bundles (:func:`k3rocm.deploy.scale.k8s.validate`, the one mechanism of
  ``make render-k8s``);
* a Pod Security Standards evaluation of every pod template against ``baseline`` and
  ``restricted``: :data:`PSS_CHECKS`, one row per check of k8s.io/pod-security-admission
  v0.36.2 (commit 39b45cd167e1bd665aaeefc6e1acc1cc753259f2, policy version "latest" as of
  Kubernetes 1.36), each citing its ``policy/check_*.go:line``, the published standard at
  https://kubernetes.io/docs/concepts/security/pod-security-standards/. Written from reading
  that source: Go is not available here, so the real evaluator was never run against these
  pods; a cluster's ``--dry-run=server`` (above) is the authority.

The Pod Security verdict is informational unless the level a namespace enforces is given
(``--pod-security LEVEL`` or the ``K3_SCALE_POD_SECURITY`` setting where the settings model has
it): then a pod failing that level is a failed check. Exit codes: 0 ok, 1 a check failed, 2 bad
settings, 3 the kubeconfig's cluster does not answer.

:func:`node_selection` (used by ``make preflight`` and ``make status``) lists the cluster's
nodes with ``kubectl get nodes -o json`` and says which match the rendered server pod's
nodeSelector / required nodeAffinity, with their ``amd.com/gpu*`` labels.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from k3rocm.errors import ServerError, UsageError

K8S_MINORS = range(29, 38)  # kubernetes-validate 1.37.0 bundles 1.25 .. 1.37
PSA_SRC = "pod-security-admission@v0.36.2:policy/"
LEVELS = ("baseline", "restricted")
KUBECTL_TIMEOUT_S = 60

Pod = tuple[dict[str, Any], dict[str, Any]]  # (metadata, spec)


# --- Pod Security Standards -----------------------------------------------------------------

def _containers(spec: Mapping[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every container with its path (policy/visitor.go:27: init, regular, ephemeral)."""
    for key in ("initContainers", "containers", "ephemeralContainers"):
        for c in spec.get(key) or []:
            yield f"{key}[{c.get('name')}]", c


def _sc(c: Mapping[str, Any]) -> dict[str, Any]:
    return c.get("securityContext") or {}


def _user_ns(spec: Mapping[str, Any]) -> bool:  # policy/helpers.go:41 (1.35+ relaxations)
    return spec.get("hostUsers") is False


def _host_path(meta, spec):
    return [f"volumes[{v['name']}].hostPath" for v in spec.get("volumes") or [] if "hostPath" in v]


def _privileged(meta, spec):
    return [f"{p}.securityContext.privileged=true" for p, c in _containers(spec)
            if _sc(c).get("privileged") is True]


def _host_namespaces(meta, spec):
    return [f"{k}=true" for k in ("hostNetwork", "hostPID", "hostIPC") if spec.get(k) is True]


CAPS_BASELINE = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                 "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}


def _caps_baseline(meta, spec):
    return [f"{p}.securityContext.capabilities.add={bad}" for p, c in _containers(spec)
            if (bad := sorted(set((_sc(c).get("capabilities") or {}).get("add") or [])
                              - CAPS_BASELINE))]


def _host_ports(meta, spec):
    return [f"{p}.ports[{q.get('name') or q.get('containerPort')}].hostPort={q['hostPort']}"
            for p, c in _containers(spec) for q in c.get("ports") or [] if q.get("hostPort")]


def _apparmor(meta, spec):
    out = [f"{where}.appArmorProfile.type={sc['appArmorProfile'].get('type')}"
           for where, sc in [("securityContext", spec.get("securityContext") or {}),
                             *((f"{p}.securityContext", _sc(c)) for p, c in _containers(spec))]
           if sc.get("appArmorProfile") and sc["appArmorProfile"].get("type")
           not in ("RuntimeDefault", "Localhost")]
    notes = (meta.get("annotations") or {}).items()
    return out + [f"metadata.annotations[{k}]={v}" for k, v in notes
                  if k.startswith("container.apparmor.security.beta.kubernetes.io/")
                  and v and v != "runtime/default" and not v.startswith("localhost/")]


SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}


def _selinux(meta, spec):
    out = []
    for where, sc in [("securityContext", spec.get("securityContext") or {}),
                      *((f"{p}.securityContext", _sc(c)) for p, c in _containers(spec))]:
        o = sc.get("seLinuxOptions") or {}
        if o.get("type", "") not in SELINUX_TYPES:
            out.append(f"{where}.seLinuxOptions.type={o['type']}")
        out += [f"{where}.seLinuxOptions.{k} set" for k in ("user", "role") if o.get(k)]
    return out


def _proc_mount(meta, spec, relax: bool = True):
    if relax and _user_ns(spec):
        return []
    return [f"{p}.securityContext.procMount={_sc(c)['procMount']}" for p, c in _containers(spec)
            if _sc(c).get("procMount") not in (None, "Default")]


def _seccomp(meta, spec, required: bool):
    ok = ("RuntimeDefault", "Localhost")
    pod = (spec.get("securityContext") or {}).get("seccompProfile")
    out = [f"securityContext.seccompProfile.type={pod.get('type')}"] if pod and \
        pod.get("type") not in ok else []
    for p, c in _containers(spec):
        own = _sc(c).get("seccompProfile")
        if own and own.get("type") not in ok:
            out.append(f"{p}.securityContext.seccompProfile.type={own.get('type')}")
        elif required and not own and not (pod and pod.get("type") in ok):
            out.append(f"{p}.securityContext.seccompProfile unset (pod level unset too)")
    return out


SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range",
                "net.ipv4.ip_unprivileged_port_start", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout",
                "net.ipv4.tcp_keepalive_intvl", "net.ipv4.tcp_keepalive_probes",
                "net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem"}


def _sysctls(meta, spec):
    return [f"securityContext.sysctls[{s['name']}]"
            for s in (spec.get("securityContext") or {}).get("sysctls") or []
            if s["name"] not in SAFE_SYSCTLS]


def _windows_host_process(meta, spec):
    return [f"{where}.windowsOptions.hostProcess=true"
            for where, sc in [("securityContext", spec.get("securityContext") or {}),
                              *((f"{p}.securityContext", _sc(c)) for p, c in _containers(spec))]
            if (sc.get("windowsOptions") or {}).get("hostProcess") is True]


def _host_probes(meta, spec):
    out = []
    for p, c in _containers(spec):
        handlers = [(k, c.get(k)) for k in ("livenessProbe", "readinessProbe", "startupProbe")]
        handlers += [(f"lifecycle.{k}", (c.get("lifecycle") or {}).get(k))
                     for k in ("postStart", "preStop")]
        out += [f"{p}.{k}.{kind}.host={h[kind]['host']}" for k, h in handlers if h
                for kind in ("httpGet", "tcpSocket") if (h.get(kind) or {}).get("host")]
    return out


def _windows(spec) -> bool:
    return (spec.get("os") or {}).get("name") == "windows"


def _priv_escalation(meta, spec):
    if _windows(spec):
        return []
    return [f"{p}.securityContext.allowPrivilegeEscalation "
            f"{'unset' if 'allowPrivilegeEscalation' not in _sc(c) else '!= false'}"
            for p, c in _containers(spec) if _sc(c).get("allowPrivilegeEscalation") is not False]


RESTRICTED_VOLUMES_OK = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "image",
                         "persistentVolumeClaim", "projected", "secret"}


def _restricted_volumes(meta, spec):
    return [f"volumes[{v['name']}].{kind}" for v in spec.get("volumes") or []
            for kind in [next((k for k in v if k != "name"), "unknown")]
            if kind not in RESTRICTED_VOLUMES_OK]


def _run_as_non_root(meta, spec):
    if _user_ns(spec):
        return []
    pod = (spec.get("securityContext") or {}).get("runAsNonRoot")
    out = ["securityContext.runAsNonRoot=false"] if pod is False else []
    for p, c in _containers(spec):
        own = _sc(c).get("runAsNonRoot")
        if own is False:
            out.append(f"{p}.securityContext.runAsNonRoot=false")
        elif own is None and pod is not True:
            out.append(f"{p}.securityContext.runAsNonRoot unset (pod level unset too)")
    return out


def _run_as_user(meta, spec):
    if _user_ns(spec):
        return []
    return [f"{where}.runAsUser=0"
            for where, sc in [("securityContext", spec.get("securityContext") or {}),
                              *((f"{p}.securityContext", _sc(c)) for p, c in _containers(spec))]
            if sc.get("runAsUser") == 0]


def _caps_restricted(meta, spec):
    if _windows(spec):
        return []
    out = []
    for p, c in _containers(spec):
        caps = _sc(c).get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"{p}.securityContext.capabilities.drop lacks ALL")
        if bad := sorted(set(caps.get("add") or []) - {"NET_BIND_SERVICE"}):
            out.append(f"{p}.securityContext.capabilities.add={bad}")
    return out


class PSSCheck(NamedTuple):
    id: str  # the upstream check ID
    level: str
    reason: str  # the upstream ForbiddenReason
    source: str  # file:line of the evaluated function (PSA_SRC)
    check: Callable[[dict[str, Any], dict[str, Any]], list[str]]  # -> failing field paths
    overrides: str | None = None  # the baseline check ID this restricted check replaces


# One row per check of the standard; restricted = every baseline row + the restricted rows,
# a restricted row replacing the baseline row it overrides (OverrideCheckIDs upstream).
PSS_CHECKS: tuple[PSSCheck, ...] = (
    PSSCheck("hostPathVolumes", "baseline", "hostPath volumes",
             "check_hostPathVolumes.go:58", _host_path),
    PSSCheck("privileged", "baseline", "privileged", "check_privileged.go:56", _privileged),
    PSSCheck("hostNamespaces", "baseline", "host namespaces",
             "check_hostNamespaces.go:58", _host_namespaces),
    PSSCheck("capabilities_baseline", "baseline", "non-default capabilities",
             "check_capabilities_baseline.go:79", _caps_baseline),
    PSSCheck("hostPorts", "baseline", "hostPort", "check_hostPorts.go:60", _host_ports),
    PSSCheck("appArmorProfile", "baseline", "appArmorProfile",
             "check_appArmorProfile.go:83", _apparmor),
    PSSCheck("seLinuxOptions", "baseline", "seLinuxOptions",
             "check_seLinuxOptions.go:86", _selinux),
    PSSCheck("procMount", "baseline", "procMount",
             "check_procMount_baseline.go:100", _proc_mount),
    PSSCheck("seccompProfile_baseline", "baseline", "seccompProfile",
             "check_seccompProfile_baseline.go:121",
             lambda m, s: _seccomp(m, s, required=False)),
    PSSCheck("sysctls", "baseline", "forbidden sysctls", "check_sysctls.go:120", _sysctls),
    PSSCheck("windowsHostProcess", "baseline", "windowsHostProcess",
             "check_windowsHostProcess.go:59", _windows_host_process),
    PSSCheck("hostProbesAndHostLifecycle", "baseline", "probe or lifecycle host",
             "check_hostProbesAndhostLifecycle.go:76", _host_probes),
    PSSCheck("allowPrivilegeEscalation", "restricted", "allowPrivilegeEscalation != false",
             "check_allowPrivilegeEscalation.go:86", _priv_escalation),
    PSSCheck("restrictedVolumes", "restricted", "restricted volume types",
             "check_restrictedVolumes.go:88", _restricted_volumes, "hostPathVolumes"),
    PSSCheck("runAsNonRoot", "restricted", "runAsNonRoot != true",
             "check_runAsNonRoot.go:67", _run_as_non_root),
    PSSCheck("runAsUser", "restricted", "runAsUser=0", "check_runAsUser.go:68", _run_as_user),
    PSSCheck("seccompProfile_restricted", "restricted", "seccompProfile",
             "check_seccompProfile_restricted.go:148",
             lambda m, s: _seccomp(m, s, required=True), "seccompProfile_baseline"),
    PSSCheck("capabilities_restricted", "restricted", "unrestricted capabilities",
             "check_capabilities_restricted.go:138", _caps_restricted, "capabilities_baseline"),
    PSSCheck("procMount_restricted", "restricted", "procMount",
             "check_procMount_restricted.go (procMount_1_0 at check_procMount_baseline.go:66)",
             lambda m, s: _proc_mount(m, s, relax=False), "procMount"),
)


def pss_checks(level: str) -> list[PSSCheck]:
    if level == "baseline":
        return [c for c in PSS_CHECKS if c.level == "baseline"]
    replaced = {c.overrides for c in PSS_CHECKS if c.level == "restricted"}
    return [c for c in PSS_CHECKS if c.id not in replaced]


def evaluate(meta: dict[str, Any], spec: dict[str, Any], level: str
             ) -> list[tuple[PSSCheck, list[str]]]:
    """The checks of ``level`` this pod fails, each with its failing field paths."""
    return [(c, bad) for c in pss_checks(level) if (bad := c.check(meta, spec))]


def pod_templates(objs: list[dict[str, Any]]) -> Iterator[tuple[str, dict, dict]]:
    """(``Kind/name``, pod metadata, pod spec) of every pod template (the Deployments')."""
    for o in objs:
        spec = o.get("spec") or {}
        if "template" in spec:
            yield (f"{o['kind']}/{o['metadata']['name']}", spec["template"].get("metadata") or {},
                   spec["template"]["spec"])


def pss_lines(objs: list[dict[str, Any]], enforce: str | None = None) -> tuple[list[str], bool]:
    """One line per pod template (every level's verdict); failed = fails ``enforce``."""
    lines, failed = [], False
    for what, meta, spec in pod_templates(objs):
        parts = []
        for level in LEVELS:
            bad = evaluate(meta, spec, level)
            parts.append(f"{level} ok" if not bad else f"{level} FAIL " + "; ".join(
                f"{c.reason} ({', '.join(paths)})" for c, paths in bad))
            failed |= bool(bad) and level == enforce
        lines.append(f"{what}: " + "; ".join(parts))
    return lines, failed


# --- strict schemas -----------------------------------------------------------------------

def schema_lines(objs: list[dict[str, Any]]) -> tuple[list[str], bool]:
    from k3rocm.deploy.scale.k8s import validate

    try:
        import kubernetes_validate  # noqa: F401
    except ImportError:
        raise UsageError("kubernetes-validate is not installed: `make venv` (host extras)"
                         ) from None
    ok, lines = [], []
    for minor in K8S_MINORS:
        try:
            validate(objs, f"1.{minor}.0")
            ok.append(minor)
        except UsageError as exc:
            lines.append(f"FAIL {exc}")
    if ok:
        lines.insert(0, f"ok   {len(objs)} objects against the strict schemas of Kubernetes "
                        + ", ".join(f"1.{m}" for m in ok))
    return lines, len(ok) != len(K8S_MINORS)


# --- the cluster: kubectl -----------------------------------------------------------------

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


def reachable(kc: str, environ: Mapping[str, str] | None = None) -> None:
    """ServerError (exit 3, one line) unless the kubeconfig's API server answers /version."""
    r = kubectl(kc, "get", "--raw", "/version", "--request-timeout=10s", environ=environ)
    if r.returncode != 0:
        why = (r.stderr.strip().splitlines() or [f"kubectl exit {r.returncode}"])[-1]
        raise ServerError(f"the cluster in KUBECONFIG={kc} does not answer: {why} (check "
                          "`kubectl cluster-info`, or unset KUBECONFIG for the offline checks)")


DRY_RUN = ("apply", "--dry-run=server", "--validate=strict",
           f"--request-timeout={KUBECTL_TIMEOUT_S}s", "-f", "-")


def dry_run_lines(kc: str, manifests: str, environ: Mapping[str, str] | None = None
                  ) -> tuple[list[str], bool]:
    r = kubectl(kc, *DRY_RUN, stdin=manifests, environ=environ)
    lines = [f"ok   {ln}" for ln in r.stdout.splitlines() if ln.strip()]
    lines += [f"FAIL {ln}" for ln in r.stderr.splitlines() if ln.strip()]
    if r.returncode != 0 and not r.stderr.strip():
        lines.append(f"FAIL kubectl exit {r.returncode}")
    return lines, r.returncode != 0


# --- node selection (make preflight, make status) -----------------------------------------

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
    """The rendered server pod spec (the server Deployment's)."""
    from k3rocm.deploy.scale.k8s import APP

    return next(spec for what, _, spec in pod_templates(objs) if what.split("/", 1)[1] == APP)


def node_selection(objs: list[dict[str, Any]], environ: Mapping[str, str] | None = None
                   ) -> tuple[str, str]:
    """(ok | fail | skip, what was found): the cluster's nodes the server pod may run on."""
    kc, why = kubeconfig(environ)
    if kc is None:
        return "skip", f"skipped: {why}"
    r = kubectl(kc, "get", "nodes", "-o", "json", "--request-timeout=15s", environ=environ)
    if r.returncode != 0:
        return "fail", "kubectl get nodes: " + (r.stderr.strip().splitlines() or ["failed"])[-1]
    spec = server_pod(objs)
    nodes = json.loads(r.stdout).get("items") or []
    parts = []
    for n in nodes:
        gpu = {k: v for k, v in (n["metadata"].get("labels") or {}).items()
               if k.startswith("amd.com/gpu")}
        parts.append(f"{n['metadata']['name']} {'matches' if node_matches(spec, n) else 'no'} "
                     f"{json.dumps(gpu, sort_keys=True)}")
    hits = sum(node_matches(spec, n) for n in nodes)
    return ("ok" if hits else "fail",
            f"{hits} of {len(nodes)} nodes match the server pod's node selection: "
            + "; ".join(parts))


def k8s_check(objs: list[dict[str, Any]], manifests: str, enforce: str | None = None,
              environ: Mapping[str, str] | None = None, out: Callable[[str], None] = print
              ) -> int:
    """Every check on the rendered ``objs`` (``manifests``: the same as YAML); the exit code."""
    kc, why = kubeconfig(environ)
    if kc is not None:
        reachable(kc, environ)  # exit 3 in one line, before anything is printed
    lines, failed = schema_lines(objs)
    out("strict schemas (kubernetes-validate, offline):")
    for ln in lines:
        out(f"  {ln}")
    lines, bad = pss_lines(objs, enforce)
    out("Pod Security Standards (offline reading of pod-security-admission v0.36.2; "
        + (f"enforced level: {enforce})" if enforce else "informational: no enforced level)"))
    for ln in lines:
        out(f"  {ln}")
    failed |= bad
    if kc is None:
        out(f"cluster: {why}: offline checks only")
    else:
        out(f"cluster (KUBECONFIG={kc}): kubectl {' '.join(DRY_RUN)}")
        lines, bad = dry_run_lines(kc, manifests, environ)
        for ln in lines:
            out(f"  {ln}")
        failed |= bad
    out("k8s-check: " + ("FAILED" if failed else "ok"))
    return 1 if failed else 0


def cluster_nodes(scale, dotenv: str | os.PathLike | None = ".env",
                  environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """:func:`node_selection` for the current settings (``make preflight``, ``make status``):
    skipped without a kubeconfig or when the manifests cannot be rendered."""
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
