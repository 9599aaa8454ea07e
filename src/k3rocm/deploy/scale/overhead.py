"""``make router-overhead``: request i goes straight to node ``i mod N``, then through the
router, ``n`` times after a warm-up. Client time minus the server's own time (the delta of
``vllm:e2e_request_latency_seconds_sum`` over every node) is what a path adds; reported: per-path
means, the router's added ms and its fraction of a direct request."""

from __future__ import annotations

import statistics
import time
from typing import Any

from k3rocm.deploy.server_api import ServerAPI, metric_sum


def _e2e_sum(api: ServerAPI) -> float:
    return metric_sum(api.metrics_text(timeout=10), "vllm:e2e_request_latency_seconds_sum") or 0.0


def measure(router_url: str, node_urls: list[str], model: str, n: int = 24,
            max_tokens: int = 8, api_key: str | None = None) -> dict[str, Any]:
    nodes = [ServerAPI(u, api_key, timeout=120) for u in node_urls]
    router = ServerAPI(router_url, api_key, timeout=120)
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0}
    samples: dict[str, list[tuple[float, float]]] = {"direct": [], "router": []}
    for i in range(n + 1):
        for path, api in (("direct", nodes[i % len(nodes)]), ("router", router)):
            before = sum(_e2e_sum(node) for node in nodes)
            t0 = time.perf_counter()
            r = api.post("/v1/completions", json=body)
            client = time.perf_counter() - t0
            r.raise_for_status()
            server = sum(_e2e_sum(node) for node in nodes) - before
            if i > 0:  # warm-up
                samples[path].append((client, server))
    out: dict[str, Any] = {"requests_per_path": n, "max_tokens": max_tokens}
    for path, rows in samples.items():
        out[f"{path}_client_s"] = statistics.mean(c for c, _ in rows)
        out[f"{path}_server_s"] = statistics.mean(s for _, s in rows)
        out[f"{path}_overhead_s"] = statistics.mean(c - s for c, s in rows)
    out["router_added_s"] = out["router_overhead_s"] - out["direct_overhead_s"]
    out["added_fraction"] = out["router_added_s"] / out["direct_client_s"]
    out["overhead_ratio"] = (out["router_overhead_s"] / out["direct_overhead_s"]
                             if out["direct_overhead_s"] > 0 else None)
    return out


def format_figures(f: dict[str, Any]) -> str:
    ms = {k: 1000 * v for k, v in f.items() if k.endswith("_s")}
    ratio = "n/a" if f["overhead_ratio"] is None else f"{f['overhead_ratio']:.2f}"
    return (f"router overhead ({f['requests_per_path']} interleaved requests per path, "
            f"{f['max_tokens']} tokens each): path overhead (client time minus the server's "
            f"e2e time) via router {ms['router_overhead_s']:.1f} ms, direct "
            f"{ms['direct_overhead_s']:.1f} ms, ratio {ratio}; the router adds "
            f"{ms['router_added_s']:+.1f} ms per request = {100 * f['added_fraction']:+.2f}% "
            f"of a direct request ({ms['direct_client_s']:.1f} ms client time; via router "
            f"{ms['router_client_s']:.1f} ms)")
