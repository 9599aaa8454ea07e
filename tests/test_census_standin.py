"""The census against real vLLM (CPU stand-in) through the real profiler endpoints: a live
census of the stock server, and census-ab with the overlay forced (ROCm/AITER doubles, tiny
DeepSeek-V3 bound) and through the plugin's upstream hook (overlay skipped)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, build_server_image, free_port, run_cli, standin_tag
from server_fixture import MODELS_DIR, SMOKE_MODEL, standin_server  # noqa: F401

pytestmark = [pytest.mark.docker, pytest.mark.server]

TRACE_DIR = "/tmp/k3rocm-traces"
FORCE_TAG = "k3rocm/census-test:cpu-0.32.0-overlay-force"
BIND = "vllm.model_executor.models.deepseek_v2"


def _smoke_layers() -> int:
    return json.loads((MODELS_DIR / SMOKE_MODEL / "config.json").read_text())[
        "num_hidden_layers"]


def _census_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("K3_")}
    env["PYTHONPATH"] = str(REPO / "src")
    return env


@pytest.fixture(scope="module")
def profiled_server(standin_server):  # noqa: F811
    """The session server: its profiler writes to its results volume, as compose mounts it
    (host dir -> /results, K3_PROFILER_DIR=/results/traces)."""
    assert standin_server.env["K3_PROFILER_DIR"] == "/results/traces"
    return standin_server


def test_census_live_stock_server(profiled_server, tmp_path):
    server = profiled_server
    p = subprocess.run(
        [sys.executable, "-m", "k3rocm", "census", "--url", server.base_url,
         "--container", server.container.name, "--model-dir", str(server.tokenizer_path),
         "--fusions", "all=off", "--concurrency", "4", "--max-tokens", "256",
         "--steps", "6", "--results", str(tmp_path)],
        env=_census_env(), capture_output=True, text=True, timeout=600)
    print(p.stdout, p.stderr[-3000:])
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    run_dir = next(tmp_path.glob("*-census"))
    data = json.loads((run_dir / "census.json").read_text())
    layers = _smoke_layers()
    assert data["model"]["mla_layers"] == layers
    rank0 = data["ranks"][0]
    assert rank0["mode"] == "cpu" and rank0["steps"] == 6 and rank0["decode_steps"] >= 1
    steps = rank0["steps"]
    # the real trace: the stock MLA layer's KV-cache write once per layer and step; the
    # native RMSNorm (one aten::rsqrt each) 4x per layer (input, post, q_a, kv_a) + final norm
    per_step = rank0["per_step"]
    assert all(s.get("vllm::unified_mla_kv_cache_update") == layers for s in per_step)
    assert all(s.get("aten::rsqrt") == 4 * layers + 1 for s in per_step)
    sep = next(c for c in data["checks"] if c["role"] == "qk_norm")
    assert (sep["expected"], sep["seen"], sep["status"]) == (2 * layers * steps,) * 2 + ("ok",)
    assert data["provenance"]["server"]["container"]["image_id"]
    # the server's argv/env as `k3rocm serve` rendered them in the container, not from /proc
    assert "/tmp/k3rocm-rendered.json" in data["provenance"]["server_settings_from"]
    assert data["provenance"]["load"]["prefill_s"] >= 0
    assert list((run_dir / "traces").glob("*.pt.trace.json.gz"))
    # collected from the results volume on the host (the server container's bind mount)
    assert list((server.results_dir / "traces").glob("*.pt.trace.json.gz"))
    assert "from " + str(server.results_dir / "traces") in p.stderr
    md = (run_dir / "census.md").read_text()
    assert "Verdict: **PASS**" in md

    # The same real traces claimed as "q/kv norm on" fail: the counts and the missing records.
    q = run_cli("census", "--trace-dir", str(run_dir / "traces"), "--model-dir",
                str(MODELS_DIR / SMOKE_MODEL), "--fusions", "qk_norm=on,decode_qprep=off",
                "--world-size", "1", "--results", str(tmp_path / "claimed"))
    assert q.returncode == 1, q.stdout + q.stderr
    rows = [ln for ln in q.stdout.splitlines() if " FAIL " in ln
            and not ln.startswith("census:")]
    # the records row, the fused and stock counts, the steps off the asked path, the verdict
    assert len(rows) == 5, rows
    assert any("the overlay did not run" in r for r in rows)
    assert any(r.startswith("engine steps off the asked q/kv RMSNorm path") for r in rows)
    assert any(r.startswith("q/kv RMSNorm fusion (qk_norm asked on): both halves")
               for r in rows)
    fused = next(r for r in rows if "fused q/kv RMSNorm launches" in r)
    assert f" {layers * steps} " in fused and " 0 " in fused
    assert any("stock q/kv RMSNorm launches" in r for r in rows)


DOUBLES_DOCKERFILE = """FROM {base}
COPY doubles/ /opt/k3rocm-test-doubles/
ENV PYTHONPATH=/opt/k3rocm-test-doubles
"""
# writer -> (image tag, the reason its records give asked on, asked off)
WRITERS = {"overlay": ("k3rocm/census-test:cpu-0.32.0-overlay-force-doubles",
                       "fused_mla_dual_rms_norm", "K3_FUSE_QK_NORM=0"),
           "upstream": ("k3rocm/census-test:cpu-0.32.0-hook-doubles",
                        "upstream's gates: on", "K3_FUSE_QK_NORM=0 (hook)")}
WHO = {"overlay": "the overlay", "upstream": "the upstream hook"}


def _doubles_image(client, writer: str, server_image: str, ctx: Path) -> str:
    """The test doubles over the overlay forced onto upstream amd/mla.py ("overlay"), or over
    the session's serving image (overlay auto = skipped: upstream's own file, "upstream")."""
    import shutil

    base = build_server_image(client, standin_tag(), FORCE_TAG, overlay_mode="force") \
        if writer == "overlay" else server_image
    shutil.copytree(REPO / "tests" / "doubles", ctx / "doubles",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (ctx / "Dockerfile").write_text(DOUBLES_DOCKERFILE.format(base=base))
    client.images.build(path=str(ctx), tag=WRITERS[writer][0], rm=True,
                        labels={"org.k3rocm.test": "census"})
    return WRITERS[writer][0]


@pytest.mark.parametrize("writer", ["overlay", "upstream"])
def test_census_ab_both_halves_and_records(docker_client, server_image, tmp_path_factory,
                                           tmp_path, writer):
    from server_fixture import ensure_smoke_model

    from k3rocm.serving.decisions import records_from_log

    image = _doubles_image(docker_client, writer, server_image, tmp_path_factory.mktemp("img"))
    ensure_smoke_model(docker_client, image)
    env = {**_census_env(), "K3_PROFILE": "cpu-smoke", "K3_MODEL": f"/models/{SMOKE_MODEL}",
           "K3_SERVED_MODEL_NAME": SMOKE_MODEL, "K3_MODELS_DIR": str(MODELS_DIR),
           "K3_PROFILER_MAX_ITERATIONS": "6"}
    p = subprocess.run(
        [sys.executable, "-m", "k3rocm", "census-ab", "--image", image, "--on", "qk_norm",
         "--port", str(free_port()), "--server-env", "K3_TEST_DOUBLE_ROCM=1",
         "--server-env", f"K3_TEST_BIND_MODULES={BIND}", "--no-gpu",
         "--model-dir", str(MODELS_DIR / SMOKE_MODEL), "--concurrency", "2",
         "--max-tokens", "128", "--server-timeout", "420", "--results", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=1200)
    print(p.stdout[-6000:], p.stderr[-4000:])
    assert p.returncode == 0 and "census-ab: PASS" in p.stdout, p.stdout[-4000:] + p.stderr[-4000:]
    assert "2 cold server start(s) in the order A B" in p.stderr
    run_dir = next(tmp_path.glob("*-census-ab"))
    _, on_reason, off_reason = WRITERS[writer]
    # each arm's records: written by ``writer``, asked on -> on, asked off -> off, the decode
    # Q-prep off (it needs an fp8 KV cache); the census cross-checked them with the claim
    for arm, state in (("on", "on"), ("off", "off")):
        log = (run_dir / arm / "server.log").read_text(errors="replace")
        if writer == "upstream":  # upstream's file served, not the overlay
            assert "k3rocm upstream hook: vllm.models.kimi_k3.amd.mla." in log, log[-3000:]
        target = [r for r in records_from_log(log, arm) if r.layer_kind == "target"]
        assert target, log[-3000:]
        for r in target:
            assert (r.writer, r.states["qk_norm"]) == (writer, state)
            assert r.states["decode_qprep"] == "off" if writer == "upstream" else \
                r.states["decode_qprep"] != "on"
            assert writer == "overlay" or r.phase == "construct"
            assert r.reasons["qk_norm"].startswith(on_reason if arm == "on" else off_reason)
            assert r.asked["qk_norm"] is (arm == "on")
    assert f"every target process (1, written by {WHO[writer]}) reports ON ({on_reason}" \
        in p.stdout
    assert f"every target process (1, written by {WHO[writer]}) reports OFF ({off_reason})" \
        in p.stdout
    # one run record layout: each arm's says what its servers ran; the A/B's lists both arms
    for arm in ("off", "on"):
        rec = json.loads((run_dir / arm / "provenance.json").read_text())
        assert (rec["deployment"]["image"], rec["deployment"]["cpu"]) == (image, True)
        assert list((run_dir / arm / "traces").glob("*.pt.trace.json.gz"))
    top = json.loads((run_dir / "provenance.json").read_text())
    assert top["schema"] == "k3rocm.runrecord/1" and top["image"] == image
    assert {Path(f["path"]).parts[-3] for f in top["trace_files"]} == {"off", "on"}
    assert "Decode kernel census A/B" in (run_dir / "ab.md").read_text()
    ab = json.loads((run_dir / "ab.json").read_text())
    off, on = ab["arms"]["off"], ab["arms"]["on"]
    assert (off["claim"]["qk_norm"], on["claim"]["qk_norm"]) == (False, True)
    assert (off["claim"]["decode_qprep"], on["claim"]["decode_qprep"]) == (False, False)
    assert "K3_FUSE_QK_NORM=1" in on["claim"]["detail"]["qk_norm"]
    for arm in (off, on):  # the records rows and the q/kv norm fusion's both-halves row: ok
        rows = [c for c in arm["checks"] if c["role"] == "records" and c["fusion"]]
        assert sorted(c["fusion"] for c in rows) == ["decode_qprep", "qk_norm"], rows
        assert all(c["status"] == "ok" for c in rows), rows
        [halves] = [c for c in arm["checks"] if c["scope"] == "fusion"
                    and c["fusion"] == "qk_norm" and c["rank"] == 0]
        assert halves["status"] == "ok", halves

    def check(arm, role):
        return next(c for c in arm["checks"] if c["role"] == role and c["rank"] == 0)

    census = {a: json.loads((run_dir / a / "census.json").read_text()) for a in ("off", "on")}
    assert census["off"]["verdict"] == census["on"]["verdict"] == "PASS"
    layers = _smoke_layers()
    # both halves, each arm judged on the steps its own profile window caught: asked on, one
    # fused launch per MLA layer and step and no stock pair; asked off, the pair, no fused one
    steps = {a: census[a]["ranks"][0]["steps"] for a in ("off", "on")}
    f_on, f_off = check(on, "fused_qk_norm"), check(off, "fused_qk_norm")
    assert (f_on["expected"], f_on["seen"]) == (layers * steps["on"],) * 2
    assert f_off["seen"] == 0
    s_on, s_off = check(on, "qk_norm"), check(off, "qk_norm")
    assert s_on["seen"] == 0 and s_off["seen"] == 2 * layers * steps["off"]
    # the A/B: off - on of all RMSNorm launches per decode step is the q/kv pair
    dsteps = census["on"]["ranks"][0]["decode_steps"]
    rows = {r["fusion"]: r for r in ab["comparison"]["rows"] if r["rank"] == 0}
    assert (rows["qk_norm"]["on_fused"], rows["qk_norm"]["off_fused"]) == (layers * dsteps, 0)
    assert rows["qk_norm"]["off_stock"] == 2 * layers * dsteps
    ab_check = next(c for c in ab["comparison"]["checks"] if c["rank"] == 0)
    assert (ab_check["expected"], ab_check["seen"], ab_check["status"]) == \
        (2 * layers * dsteps, 2 * layers * dsteps, "ok")
    per = census["on"]["per_mla_layer_per_decode_step"][0]["decode_qprep"]
    assert per["cache_write_launches"] == layers * dsteps and per["fused_launches"] == 0
