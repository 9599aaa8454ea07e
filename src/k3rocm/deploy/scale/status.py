"""``make status``: per replica /health, served model, prefix-cache hit rate
(``vllm:prefix_cache_hits_total / _queries_total``), and for a local container its image and
K3ROCM-DECISION fusions; the router's /health (503 as soon as one worker is down). Summary
``ok, N of N``, ``degraded, k of N`` or ``down, 0 of N``."""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlparse

from k3rocm.deploy.provenance import find_server_container
from k3rocm.deploy.scale.settings import ScaleSettings, load_scale
from k3rocm.deploy.server_api import ServerAPI, Unreachable, metric_sum
from k3rocm.errors import ServerError, UsageError
from k3rocm.serving.decisions import final_in_log as parse_decisions  # last record per process

HTTP_TIMEOUT = 5.0


@dataclass
class ReplicaStatus:
    address: str
    url: str
    health: str  # ok | http <code> | unreachable (<error>)
    models: list[str] = field(default_factory=list)
    prefix_cache_hit_rate: float | None = None  # hits / queries (tokens) since start
    fusions: str = "unknown (no local container)"
    image_id: str | None = None
    container: str | None = None

    @property
    def healthy(self) -> bool:
        return self.health == "ok"


@dataclass
class RouterStatus:
    url: str
    health: str  # ok | http <code> | unreachable (<error>)
    summary: str  # "ok, 2 of 2" | "degraded, 1 of 2" | "down, 0 of 2" | "router unreachable"
    healthy: int
    total: int


def prefix_cache_hit_rate(metrics_text: str) -> float | None:
    queries = metric_sum(metrics_text, "vllm:prefix_cache_queries_total")
    hits = metric_sum(metrics_text, "vllm:prefix_cache_hits_total") or 0.0
    return hits / queries if queries else None


def _health(api: ServerAPI) -> str:
    try:
        code = api.health()
    except Unreachable as exc:
        return f"unreachable ({exc.reason})"
    return "ok" if code == 200 else f"http {code}"


def summarize_decisions(records: dict[tuple[Any, Any], dict[str, Any]]) -> str:
    """e.g. ``target: qk_norm=on decode_qprep=off`` (``mixed`` when processes disagree)."""
    if not records:
        return ("no K3ROCM-DECISION records (neither the overlay nor the upstream hook wrote "
                "any in this server)")
    per: dict[str, dict[str, set[str]]] = {}
    for (_pid, kind), rec in sorted(records.items(), key=lambda kv: str(kv[0])):
        for fusion, d in (rec.get("fusions") or {}).items():
            per.setdefault(str(kind), {}).setdefault(fusion, set()).add(str(d.get("state")))
    return "; ".join(f"{kind}: " + " ".join(f"{f}={next(iter(s)) if len(s) == 1 else 'mixed'}"
                                            for f, s in sorted(fusions.items()))
                     for kind, fusions in per.items())


def replica_status(address: str, client=None, api_key: str | None = None) -> ReplicaStatus:
    url = f"http://{address}"
    api = ServerAPI(url, api_key, timeout=HTTP_TIMEOUT)
    st = ReplicaStatus(address=address, url=url, health=_health(api))
    if st.health == "ok":
        with contextlib.suppress(ServerError):
            st.models = api.models()
        with contextlib.suppress(ServerError):
            st.prefix_cache_hit_rate = prefix_cache_hit_rate(api.metrics_text())
    c = find_server_container(client, url) if client is not None else None
    if c is not None:
        st.container = c.name
        st.image_id = (c.attrs or {}).get("Image")
        try:
            logs = c.logs().decode(errors="replace")
            st.fusions = summarize_decisions(parse_decisions(logs))
        except Exception as exc:  # noqa: BLE001 - the container went away meanwhile
            st.fusions = f"unknown (log not readable: {exc.__class__.__name__})"
    return st


def router_status(s: ScaleSettings, replicas: list[ReplicaStatus]) -> RouterStatus:
    total = len(replicas)
    healthy = sum(1 for r in replicas if r.healthy)
    health = _health(ServerAPI(s.router_url, timeout=HTTP_TIMEOUT))
    summary = ("router unreachable" if health.startswith("unreachable") else
               f"ok, {healthy} of {total}" if health == "ok" and healthy == total else
               f"down, 0 of {total}" if healthy == 0 else f"degraded, {healthy} of {total}")
    return RouterStatus(s.router_url, health, summary, healthy, total)


def scale_status(s: ScaleSettings, client=None,
                 api_key: str | None = None) -> tuple[list[ReplicaStatus], RouterStatus]:
    if api_key is None:
        from k3rocm.deploy.deployment import load_deployment

        api_key = load_deployment().api_key
    replicas = [replica_status(a, client, api_key) for a in s.nodes]
    return replicas, router_status(s, replicas)


def format_status(replicas: list[ReplicaStatus], router: RouterStatus) -> list[str]:
    lines = []
    for i, r in enumerate(replicas):
        model = ",".join(r.models) or "-"
        image = (r.image_id or "-")[:19]
        where = f" container {r.container}" if r.container else ""
        hit = "-" if r.prefix_cache_hit_rate is None else f"{100 * r.prefix_cache_hit_rate:.1f}%"
        lines.append(f"replica {i} {r.address:<21} {r.health:<22} model {model}  "
                     f"prefix-cache hits {hit}  image {image}{where}  fusions: {r.fusions}")
    lines.append(f"router    {router.url:<21} {router.health:<22} {router.summary}")
    return lines


def status_json(replicas: list[ReplicaStatus], router: RouterStatus) -> dict[str, Any]:
    return {"replicas": [asdict(r) | {"healthy": r.healthy} for r in replicas],
            "router": asdict(router)}


def topology(url: str, environ=None) -> dict[str, Any]:
    """The ``topology`` block of a result's provenance: what ``url`` is in the scale settings."""
    try:
        s = load_scale(environ)
    except UsageError as exc:
        return {"mode": "unknown", "url": url, "error": str(exc)}
    p = urlparse(url)
    target = f"{p.hostname}:{p.port}"
    r = urlparse(s.router_url)
    via_router = s.mode != "single" and p.port == r.port and p.hostname in (
        r.hostname, "127.0.0.1", "localhost")
    block: dict[str, Any] = {"mode": s.mode, "url": url, "via_router": via_router,
                             "nodes": list(s.nodes) if s.mode != "single" else [target]}
    if s.mode != "single":
        block["router"] = {"url": s.router_url, "policy": s.router_policy,
                           "image": s.router_image}
        block["target"] = "router" if via_router else (
            "one node" if target in s.nodes else "not in K3_SCALE_NODES")
    return block
