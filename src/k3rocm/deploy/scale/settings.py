"""The K3_SCALE_* settings (``single`` or ``replicas``), read like every setting: environment
over ``.env`` (:func:`k3rocm.serving.config.read_dotenv`), one-line errors (exit 2)."""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from k3rocm.errors import UsageError
from k3rocm.serving.config import read_dotenv
from k3rocm.serving.settings import invalid

SCALE_PREFIX = "K3_SCALE_"
# vllm-router 0.1.17 `--policy` choices (from `vllm-router --help` of that wheel).
ROUTER_POLICIES = ("random", "round_robin", "cache_aware", "kv_aware", "power_of_two",
                   "consistent_hash", "sticky_least_loaded")
ENGINE_READY_ENV = "VLLM_ENGINE_READY_TIMEOUT_S"
ENGINE_READY_DEFAULT = 600  # vLLM's default (vllm/envs.py)
# registry host (a dot or a port, or localhost)/repo[:tag]@sha256:<digest>
IMAGE_REF = re.compile(r"^(?:[a-z0-9-]+(?:\.[a-z0-9-]+)+(?::\d+)?|[a-z0-9-]+:\d+|localhost)"
                       r"/[a-z0-9._/-]+(?::[\w.-]+)?@sha256:[0-9a-f]{64}$")
# AMD's node labeller (ROCm/k8s-device-plugin cmd/k8s-node-labeller): -device-id, -product-name
MI355X_NODES = ("amd.com/gpu.device-id=75a3;"
                "amd.com/gpu.product-name=AMD_Instinct_MI355X|AMD_Instinct_MI355X_OAM")
POD_SECURITY = ("privileged", "baseline", "restricted")
# Kubernetes label key (optional DNS-subdomain prefix + "/" + name) and label value.
_LABEL_NAME = r"[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_LABEL = re.compile(rf"(?:[a-z0-9](?:[-a-z0-9.]{{0,251}}[a-z0-9])?/)?{_LABEL_NAME}="
                    rf"(?:{_LABEL_NAME})?(?:\|(?:{_LABEL_NAME})?)*")
_HOSTPORT = re.compile(r"(?:\[[0-9A-Fa-f:]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?)"
                       r":(\d{1,5})")


def _rule(ok: Callable[[Any], Any], message: str, before: bool = False) -> Any:
    """A constraint: ``ok(value)``, else one line, ``message`` (``{v!r}``: the value); ``before``
    pydantic's own parsing."""
    def check(v: Any) -> Any:
        if not ok(v):
            raise ValueError(message.format(v=v))
        return v
    return BeforeValidator(check) if before else AfterValidator(check)


def _host_port(v: str) -> bool:
    m = _HOSTPORT.fullmatch(v)
    return m is not None and 1 <= int(m[1]) <= 65535


def _loopback(v: str) -> bool:
    try:
        return v == "localhost" or ipaddress.ip_address(v).is_loopback
    except ValueError:
        return False


def _selector(v: str) -> str:
    """``;`` between terms (any), ``,`` within one (all), ``|`` between values."""
    for part in (p.strip() for term in v.split(";") for p in term.split(",")):
        if not _LABEL.fullmatch(part):
            raise ValueError(f"{part!r} is not key=value[|value] with a Kubernetes label key "
                             "and values (e.g. amd.com/gpu.device-id=75a3)")
    return v


# the constrained types of the settings below; a value that does not fit is one line (exit 2)
_CSV = BeforeValidator(lambda v: [p.strip() for p in v.split(",") if p.strip()]
                       if isinstance(v, str) else v)
Nodes = Annotated[tuple[Annotated[str, _rule(_host_port, "{v!r} is not host:port (e.g. "
                                              "node1:8000,node2:8000)")], ...],
                  _CSV, _rule(lambda v: len(set(v)) == len(v), "lists a node twice")]
GroupIds = Annotated[tuple[int, ...], _rule(  # before: runs after _CSV (pydantic: right first)
    lambda v: all(str(g).isdigit() for g in v), "give numeric group ids, e.g. 44,110 (`getent "
    "group video render` on a GPU node)", before=True), _CSV]
K8sName = Annotated[str, _rule(re.compile(r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?").fullmatch,
                               "use a Kubernetes name: lower-case letters, digits and '-', at "
                               "most 63")]
Loopback = Annotated[str, _rule(_loopback, "the router's /add_worker and /remove_worker answer "
                                "anyone who reaches its port: keep it on 127.0.0.1 and expose "
                                "only the data paths through the proxy (docs/scale.md)")]


class ScaleSettings(BaseModel):
    """K3_SCALE_ + the field name in capitals; docs/scale.md's table (same order)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["single", "replicas"] = "single"
    nodes: Nodes = ()  # host:port of every node's API server
    router_host: Loopback = "127.0.0.1"
    router_port: int = Field(8080, ge=1, le=65535)
    router_metrics_port: int = Field(29000, ge=1, le=65535)  # --prometheus-port
    router_policy: Literal[ROUTER_POLICIES] = "cache_aware"  # type: ignore[valid-type]
    # --worker-startup-timeout-secs; >= VLLM_ENGINE_READY_TIMEOUT_S (checked in load_scale)
    router_startup_timeout: int = Field(7200, ge=1)
    health_interval: int = Field(10, ge=1, le=3600)  # --health-check-interval-secs
    health_threshold: int = Field(3, ge=1, le=100)  # --health-failure-threshold
    router_image: str = "k3rocm/router:0.1.17"  # Kubernetes: registry/repo@sha256:<digest>
    proxy_image: str = ""  # Kubernetes: the nginx image of the router's data-port proxy
    router_replicas: int = Field(2, ge=1, le=32)  # Kubernetes: router pods (2+: no SPOF)
    # Kubernetes: the MI355X nodes, key=v1|v2,key=v ; another term (see node_affinity_terms)
    node_selector: Annotated[str, AfterValidator(_selector)] = MI355X_NODES
    pod_security: Literal[POD_SECURITY] = "privileged"  # type: ignore[valid-type]
    models_claim: K8sName = "k3rocm-models"  # Kubernetes baseline/restricted: checkpoint PVC
    gpu_groups: GroupIds = ()  # Kubernetes restricted: GIDs owning /dev/kfd, /dev/dri
    run_as_user: int = Field(1000, ge=1, le=2147483647)  # Kubernetes restricted: server UID
    metrics_namespace: K8sName = "monitoring"  # Kubernetes: the scraper's namespace (NetworkPolicy)
    drain_timeout: int = Field(300, ge=0, le=86400)  # vLLM --shutdown-timeout (0 aborts)

    @property
    def node_affinity_terms(self) -> list[dict[str, Any]]:
        """``nodeSelectorTerms``: ``;`` between terms (any), ``,`` within one (all), ``|``
        between values."""
        return [{"matchExpressions": [
            {"key": k.strip(), "operator": "In", "values": v.split("|")}
            for k, v in (p.split("=", 1) for p in term.split(","))]}
            for term in self.node_selector.split(";")]

    @property
    def worker_urls(self) -> list[str]:
        return [f"http://{n}" for n in self.nodes]

    @property
    def router_url(self) -> str:
        host = f"[{self.router_host}]" if ":" in self.router_host else self.router_host
        return f"http://{host}:{self.router_port}"

    @property
    def routing_flags(self) -> list[str]:
        return ["--policy", self.router_policy,
                "--worker-startup-timeout-secs", str(self.router_startup_timeout),
                "--health-check-interval-secs", str(self.health_interval),
                "--health-failure-threshold", str(self.health_threshold)]

    def node_host(self, i: int) -> str:
        return self.nodes[i].rsplit(":", 1)[0].strip("[]")

    def node_port(self, i: int) -> int:
        return int(self.nodes[i].rsplit(":", 1)[1])


SCALE_ENV = {n: SCALE_PREFIX + n.upper() for n in ScaleSettings.model_fields}
SCALE_FIELD_BY_ENV = {e: n for n, e in SCALE_ENV.items()}
REMOVED_MODES = {
    "pd": "prefill/decode disaggregation was never proven to start",
    "dp-ep": "the data-parallel + expert-parallel rendering was removed (never validated on "
             "MI355X)",
}


def load_scale(environ: Mapping[str, str] | None = None,
               dotenv: str | os.PathLike | None = ".env") -> ScaleSettings:
    """ScaleSettings from the environment over ``.env``; UsageError (one line) if invalid."""
    environ = dict(os.environ if environ is None else environ)
    file_vals = read_dotenv(dotenv) if dotenv else {}
    merged: dict[str, tuple[str, str]] = {}
    for src, vals in ((".env", file_vals), ("env", environ)):
        for key, raw in vals.items():
            if key.startswith(SCALE_PREFIX):
                if key not in SCALE_FIELD_BY_ENV:
                    raise UsageError(f"{key} is not a known setting (from {src}); the scale "
                                     "settings are " + ", ".join(SCALE_FIELD_BY_ENV))
                if raw != "":
                    merged[key] = (raw, src)
    mode, mode_src = merged.get(SCALE_PREFIX + "MODE", ("", ""))
    if mode in REMOVED_MODES:
        raise UsageError(f"K3_SCALE_MODE={mode} (from {mode_src}) is not offered: "
                         f"{REMOVED_MODES[mode]} (docs/scale.md); use replicas")
    values = {SCALE_FIELD_BY_ENV[k]: raw for k, (raw, _) in merged.items()}
    try:
        s = ScaleSettings(**values)
    except ValidationError as exc:
        raise UsageError(invalid(exc, values, ScaleSettings, SCALE_ENV)) from None
    raw_ready = (environ.get(ENGINE_READY_ENV) or file_vals.get(ENGINE_READY_ENV)
                 or str(ENGINE_READY_DEFAULT))
    try:
        ready = int(float(raw_ready))
    except ValueError:
        raise UsageError(f"{ENGINE_READY_ENV}={raw_ready!r} is not valid: use seconds "
                         "(an integer)") from None
    if s.router_startup_timeout < ready:
        raise UsageError(
            f"K3_SCALE_ROUTER_STARTUP_TIMEOUT={s.router_startup_timeout} is shorter than "
            f"{ENGINE_READY_ENV}={ready}: the router would give up on a node that is "
            "still loading; raise it to at least that")
    if s.mode != "single" and len(s.nodes) < 2:
        raise UsageError(f"K3_SCALE_MODE={s.mode} needs K3_SCALE_NODES with at least 2 "
                         f"host:port entries (got {len(s.nodes)}); e.g. "
                         "K3_SCALE_NODES=node1:8000,node2:8000")
    return s


def check_image_ref(setting: str, ref: str) -> str:
    if not IMAGE_REF.match(ref or ""):
        raise UsageError(f"{setting}={ref!r} is not an image a cluster can pull: give "
                         "registry/repo@sha256:<digest> (push it first, e.g. `docker push "
                         "REGISTRY/k3rocm/server:TAG`, then read the digest with `docker "
                         "inspect --format '{{index .RepoDigests 0}}'`)")
    return ref
