"""census-ab against real vLLM (CPU stand-in) through the real profiler endpoints: both arms
served through the plugin's upstream hook on upstream's amd/mla.py (the path the shipped 0.32+
images take; the ROCm/AITER doubles over a tiny DeepSeek-V3 bound), counts, records, both halves.

The live census of a stock server is test_demo.py's end to end (its `make census`). The overlay
writer is not served here; what proves it: in real vLLM, check_overlay_wrapper.py's
test_decision_records (its records) and test_ops_per_mla_layer_per_decode_step (launches per
MLA layer and decode step), run by test_overlay_standin.py; both writers write the same record
(test_upstream_hook.py); the overlay's records judged (test_census_records.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, free_port
from server_fixture import MODELS_DIR, SMOKE_MODEL

pytestmark = [pytest.mark.docker, pytest.mark.server]

BIND = "vllm.model_executor.models.deepseek_v2"
DOUBLES_TAG = "k3rocm/census-test:cpu-0.32.0-hook-doubles"
DOUBLES_DOCKERFILE = """FROM {base}
COPY doubles/ /opt/k3rocm-test-doubles/
ENV PYTHONPATH=/opt/k3rocm-test-doubles
"""
ON_REASON, OFF_REASON = "upstream's gates: on", "K3_FUSE_QK_NORM=0 (hook)"


def _smoke_layers() -> int:
    return json.loads((MODELS_DIR / SMOKE_MODEL / "config.json").read_text())[
        "num_hidden_layers"]


def _doubles_image(client, server_image: str, ctx: Path) -> str:
    """The test doubles over the session's serving image (overlay auto = skipped: upstream's
    own amd/mla.py, hooked by the plugin)."""
    shutil.copytree(REPO / "tests" / "doubles", ctx / "doubles",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (ctx / "Dockerfile").write_text(DOUBLES_DOCKERFILE.format(base=server_image))
    client.images.build(path=str(ctx), tag=DOUBLES_TAG, rm=True,
                        labels={"org.k3rocm.test": "census"})
    return DOUBLES_TAG


def test_census_ab_both_halves_and_records(docker_client, server_image, tmp_path_factory,
                                           tmp_path):
    from server_fixture import ensure_smoke_model

    from k3rocm.serving.decisions import records_from_log

    image = _doubles_image(docker_client, server_image, tmp_path_factory.mktemp("img"))
    ensure_smoke_model(docker_client, image)
    env = {k: v for k, v in os.environ.items() if not k.startswith("K3_")}
    env.update({"PYTHONPATH": str(REPO / "src"), "K3_PROFILE": "cpu-smoke",
                "K3_MODEL": f"/models/{SMOKE_MODEL}", "K3_SERVED_MODEL_NAME": SMOKE_MODEL,
                "K3_MODELS_DIR": str(MODELS_DIR), "K3_PROFILER_MAX_ITERATIONS": "6"})
    # --max-tokens 48: profiling starts with >= 24 tokens left per stream (drive.py's half),
    # more than the 6 profiled steps (+ margin); the streams are hung up after the profile
    p = subprocess.run(
        [sys.executable, "-m", "k3rocm", "census-ab", "--image", image, "--on", "qk_norm",
         "--port", str(free_port()), "--server-env", "K3_TEST_DOUBLE_ROCM=1",
         "--server-env", f"K3_TEST_BIND_MODULES={BIND}", "--no-gpu",
         "--model-dir", str(MODELS_DIR / SMOKE_MODEL), "--concurrency", "2",
         "--max-tokens", "48", "--server-timeout", "420", "--results", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=1200)
    print(p.stdout[-6000:], p.stderr[-4000:])
    assert p.returncode == 0 and "census-ab: PASS" in p.stdout, p.stdout[-4000:] + p.stderr[-4000:]
    assert "2 cold server start(s) in the order A B" in p.stderr
    run_dir = next(tmp_path.glob("*-census-ab"))
    # each arm's records: written by the upstream hook (upstream's file served, not the
    # overlay), asked on -> on, asked off -> off, the decode Q-prep off (it needs an fp8 KV
    # cache); the census cross-checked them with the claim
    for arm, state in (("on", "on"), ("off", "off")):
        log = (run_dir / arm / "server.log").read_text(errors="replace")
        assert "k3rocm upstream hook: vllm.models.kimi_k3.amd.mla." in log, log[-3000:]
        target = [r for r in records_from_log(log, arm) if r.layer_kind == "target"]
        assert target, log[-3000:]
        for r in target:
            assert (r.writer, r.states["qk_norm"], r.phase) == ("upstream", state, "construct")
            assert r.states["decode_qprep"] == "off"
            assert r.reasons["qk_norm"].startswith(ON_REASON if arm == "on" else OFF_REASON)
            assert r.asked["qk_norm"] is (arm == "on")
    for state, reason in (("ON", f"({ON_REASON}"), ("OFF", f"({OFF_REASON})")):
        assert f"every target process (1, written by the upstream hook) reports {state} " \
            f"{reason}" in p.stdout
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
