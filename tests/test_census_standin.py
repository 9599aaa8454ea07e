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


DOUBLES_TAG = "k3rocm/census-test:cpu-0.32.0-overlay-force-doubles"
DOUBLES_DOCKERFILE = """FROM {base}
COPY doubles/ /opt/k3rocm-test-doubles/
ENV PYTHONPATH=/opt/k3rocm-test-doubles
"""


@pytest.fixture(scope="module")
def forced_image(docker_client, server_image, tmp_path_factory) -> str:
    """Our image on the 0.32.0 stand-in with the overlay forced over upstream amd/mla.py, plus
    the test doubles (a test image: the serving image never carries them)."""
    import shutil

    base = build_server_image(docker_client, standin_tag(), FORCE_TAG, overlay_mode="force")
    ctx = tmp_path_factory.mktemp("doubles-image")
    shutil.copytree(REPO / "tests" / "doubles", ctx / "doubles",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (ctx / "Dockerfile").write_text(DOUBLES_DOCKERFILE.format(base=base))
    docker_client.images.build(path=str(ctx), tag=DOUBLES_TAG, rm=True,
                               labels={"org.k3rocm.test": "census"})
    return DOUBLES_TAG


def _census_ab_qk_norm(docker_client, image: str, results) -> subprocess.CompletedProcess:
    """`k3rocm census-ab --on qk_norm` on ``image`` (smoke model, ROCm double, DeepSeek bind),
    asserted to exit 0; the arms' records and traces are the caller's to check."""
    from server_fixture import ensure_smoke_model

    ensure_smoke_model(docker_client, image)
    env = {**_census_env(), "K3_PROFILE": "cpu-smoke", "K3_MODEL": f"/models/{SMOKE_MODEL}",
           "K3_SERVED_MODEL_NAME": SMOKE_MODEL, "K3_MODELS_DIR": str(MODELS_DIR),
           "K3_PROFILER_MAX_ITERATIONS": "6"}
    p = subprocess.run(
        [sys.executable, "-m", "k3rocm", "census-ab", "--image", image, "--on", "qk_norm",
         "--port", str(free_port()), "--server-env", "K3_TEST_DOUBLE_ROCM=1",
         "--server-env", f"K3_TEST_BIND_MODULES={BIND}", "--no-gpu",
         "--model-dir", str(MODELS_DIR / SMOKE_MODEL), "--concurrency", "4",
         "--max-tokens", "256", "--server-timeout", "420", "--results", str(results)],
        env=env, capture_output=True, text=True, timeout=1200)
    print(p.stdout[-6000:], p.stderr[-4000:])
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    return p


def test_census_ab_overlay_on_off(docker_client, forced_image, tmp_path):
    p = _census_ab_qk_norm(docker_client, forced_image, tmp_path)
    # the overlay's own records, cross-checked with each arm's claim
    assert "qk_norm asked ON" in p.stdout and "reports ON (fused_mla_dual_rms_norm" in p.stdout
    assert "every target process (1, written by the overlay) reports OFF (K3_FUSE_QK_NORM=0)" \
        in p.stdout
    run_dir = next(tmp_path.glob("*-census-ab"))
    ab = json.loads((run_dir / "ab.json").read_text())
    # one run record layout: each arm's says what that arm's servers ran (--image, --no-gpu),
    # not this shell's deployment; the A/B's own lists both arms' traces
    for arm in ("off", "on"):
        rec = json.loads((run_dir / arm / "provenance.json").read_text())
        assert (rec["deployment"]["image"], rec["deployment"]["cpu"]) == (forced_image, True)
    top = json.loads((run_dir / "provenance.json").read_text())
    assert top["schema"] == "k3rocm.runrecord/1" and top["image"] == forced_image
    assert {Path(f["path"]).parts[-3] for f in top["trace_files"]} == {"off", "on"}
    layers = _smoke_layers()
    off, on = ab["arms"]["off"], ab["arms"]["on"]
    assert (off["claim"]["qk_norm"], on["claim"]["qk_norm"]) == (False, True)
    assert (off["claim"]["decode_qprep"], on["claim"]["decode_qprep"]) == (False, False)
    assert "K3_FUSE_QK_NORM=1" in on["claim"]["detail"]["qk_norm"]

    def check(arm, role):
        return next(c for c in arm["checks"] if c["role"] == role and c["rank"] == 0)

    on_census = json.loads((run_dir / "on" / "census.json").read_text())
    steps = on_census["ranks"][0]["steps"]
    # each arm is judged on the steps its own profile window caught (on a loaded machine the
    # two windows may differ by a step: seen 5 vs 6)
    off_steps = json.loads((run_dir / "off" / "census.json").read_text())["ranks"][0]["steps"]
    f_on, f_off = check(on, "fused_qk_norm"), check(off, "fused_qk_norm")
    assert (f_on["expected"], f_on["seen"]) == (layers * steps, layers * steps)
    assert f_off["seen"] == 0
    s_on, s_off = check(on, "qk_norm"), check(off, "qk_norm")
    assert s_on["seen"] == 0 and s_off["seen"] == 2 * layers * off_steps
    dsteps = on_census["ranks"][0]["decode_steps"]
    rows = {r["fusion"]: r for r in ab["comparison"]["rows"] if r["rank"] == 0}
    assert rows["qk_norm"]["on_fused"] == layers * dsteps
    assert rows["qk_norm"]["off_fused"] == 0
    assert rows["qk_norm"]["off_stock"] == 2 * layers * dsteps
    ab_check = next(c for c in ab["comparison"]["checks"] if c["rank"] == 0)
    assert (ab_check["expected"], ab_check["seen"], ab_check["status"]) == \
        (2 * layers * dsteps, 2 * layers * dsteps, "ok")
    per = on_census["per_mla_layer_per_decode_step"][0]["decode_qprep"]
    assert per["cache_write_launches"] == layers * dsteps and per["fused_launches"] == 0
    assert "2 cold server start(s) in the order A B" in p.stderr
    for arm in ("off", "on"):
        assert (run_dir / arm / "server.log").stat().st_size > 0
        assert list((run_dir / arm / "traces").glob("*.pt.trace.json.gz"))
    assert "Decode kernel census A/B" in (run_dir / "ab.md").read_text()


HOOK_TAG = "k3rocm/census-test:cpu-0.32.0-hook-doubles"


@pytest.fixture(scope="module")
def hook_image(docker_client, server_image, tmp_path_factory) -> str:
    """The session's serving image (the real Dockerfile FROM the 0.32.0 stand-in, overlay
    auto = skipped: upstream's own amd/mla.py) plus the test doubles, as ``forced_image``."""
    import shutil

    ctx = tmp_path_factory.mktemp("hook-doubles-image")
    shutil.copytree(REPO / "tests" / "doubles", ctx / "doubles",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (ctx / "Dockerfile").write_text(DOUBLES_DOCKERFILE.format(base=server_image))
    docker_client.images.build(path=str(ctx), tag=HOOK_TAG, rm=True,
                               labels={"org.k3rocm.test": "census"})
    return HOOK_TAG


def _records(server_log: Path) -> list:
    from k3rocm.serving.decisions import parse_record

    out = []
    for ln in server_log.read_text(errors="replace").splitlines():
        if "K3ROCM-DECISION " in ln:
            out.append(parse_record(json.loads(ln.split("K3ROCM-DECISION ", 1)[1]), "log"))
    return out


def test_census_ab_through_the_upstream_hook(docker_client, hook_image, tmp_path):
    p = _census_ab_qk_norm(docker_client, hook_image, tmp_path)
    assert "census-ab: PASS" in p.stdout
    run_dir = next(tmp_path.glob("*-census-ab"))
    # what served: upstream's file, not the overlay (the image's build skipped it)
    for arm in ("off", "on"):
        log = (run_dir / arm / "server.log").read_text(errors="replace")
        assert "k3rocm upstream hook: vllm.models.kimi_k3.amd.mla." in log, log[-3000:]
    # the records each arm's server wrote: the hook's, read from upstream's attribute
    recs = {arm: _records(run_dir / arm / "server.log") for arm in ("off", "on")}
    for arm, state, reason in (("on", "on", "upstream's gates: on"),
                               ("off", "off", "K3_FUSE_QK_NORM=0 (hook)")):
        target = [r for r in recs[arm] if r.layer_kind == "target"]
        assert target, recs[arm]
        for r in target:
            assert r.writer == "upstream" and r.phase == "construct"
            assert r.states["qk_norm"] == state and r.reasons["qk_norm"] == reason
            assert r.asked["qk_norm"] is (arm == "on")
            # decode Q-prep needs an fp8 KV cache: upstream's own gate says off on CPU
            assert r.states["decode_qprep"] == "off"
    # the census's cross-check of those records with each arm's claim: PASS, naming the hook
    assert ("every target process (1, written by the upstream hook) reports ON "
            "(upstream's gates: on)") in p.stdout
    assert ("every target process (1, written by the upstream hook) reports OFF "
            "(K3_FUSE_QK_NORM=0 (hook))") in p.stdout
    ab = json.loads((run_dir / "ab.json").read_text())
    off, on = ab["arms"]["off"], ab["arms"]["on"]
    assert (off["claim"]["qk_norm"], on["claim"]["qk_norm"]) == (False, True)
    for arm in (off, on):  # one records row per fusion, each a PASS
        rows = [c for c in arm["checks"] if c["role"] == "records" and c["fusion"]]
        assert sorted(c["fusion"] for c in rows) == ["decode_qprep", "qk_norm"], rows
        assert all(c["status"] == "ok" for c in rows), rows
    layers = _smoke_layers()

    def check(arm, role):
        return next(c for c in arm["checks"] if c["role"] == role and c["rank"] == 0)

    census = {a: json.loads((run_dir / a / "census.json").read_text()) for a in ("off", "on")}
    # each arm's own verdict, and the q/kv norm fusion's both-halves row in it
    assert census["off"]["verdict"] == census["on"]["verdict"] == "PASS"
    for arm in (off, on):
        [halves] = [c for c in arm["checks"] if c["scope"] == "fusion"
                    and c["fusion"] == "qk_norm" and c["rank"] == 0]
        assert halves["status"] == "ok", halves
    steps = {a: census[a]["ranks"][0]["steps"] for a in ("off", "on")}
    # both halves of the norm fusion, in upstream's own class: asked on, one fused launch per
    # MLA layer and step and no stock pair; asked off, the pair and no fused launch
    f_on, f_off = check(on, "fused_qk_norm"), check(off, "fused_qk_norm")
    assert (f_on["expected"], f_on["seen"]) == (layers * steps["on"],) * 2
    assert f_off["seen"] == 0
    s_on, s_off = check(on, "qk_norm"), check(off, "qk_norm")
    assert s_on["seen"] == 0 and s_off["seen"] == 2 * layers * steps["off"]
    assert "2 cold server start(s) in the order A B" in p.stderr
