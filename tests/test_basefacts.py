"""Base facts read from the real vLLM sources of every release 0.27.1 ... 0.34.0
(``conftest.upstream_tree``), and what they do to a render before anything loads. Expected values
are read from each release's files by hand (file:line in docs/overlay.md), never from basefacts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, upstream_tree

from k3rocm.errors import UsageError
from k3rocm.serving import basefacts
from k3rocm.serving.config import render

RELEASES = ("0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0")
BOTH = ["qk_norm", "decode_qprep"]
G, A = "gluon", "asm-padded"
# Read by hand, per release (line numbers in rocm_aiter_mla.py unless said otherwise):
#   aware: use_gluon_decode takes kv_cache_dtype (line of the def)
#   bf16 / fp8: the < 16-head verify branch taken with 1 + k query tokens on gfx950, and the
#     lines that copy a device value to the host on it (() = none)
#   view: get_mla_padded_q returns an as_strided view; cg: AiterMLAMetadataBuilder's
#     _cudagraph_support line (UNIFORM_BATCH in every release)
#   up: fusions upstream's amd/mla.py ships (and sets the hook's attribute for)
#   brk: config/vllm.py auto-enables breakable CUDA graphs for Kimi-K3 on ROCm
#   bmm: VLLM_ROCM_USE_AITER_FP8BMM / FP4BMM default (envs.py)
EXPECTED = {
    "0.27.1": dict(aware=(False, 829), bf16=(G, (1164, 1185)), fp8=(G, (1164, 1185)),
                   view=False, cg=171, up=[], brk=True, bmm=True),
    "0.28.0": dict(aware=(True, 909), bf16=(G, (1281, 1302)), fp8=(A, ()), view=False, cg=215,
                   up=[], brk=True, bmm=True),
    "0.29.0": dict(aware=(True, 1334), bf16=(G, ()), fp8=(A, ()), view=False, cg=347, up=[],
                   brk=True, bmm=True),
    "0.30.0": dict(aware=(True, 1474), bf16=(G, ()), fp8=(A, ()), view=False, cg=431,
                   up=["qk_norm"], brk=False, bmm=True),
    "0.31.0": dict(aware=(True, 1727), bf16=(G, ()), fp8=(A, ()), view=False, cg=540,
                   up=["qk_norm"], brk=False, bmm=True),
    "0.32.0": dict(aware=(True, 1805), bf16=(G, ()), fp8=(A, ()), view=False, cg=540, up=BOTH,
                   brk=False, bmm=True),
    "0.33.0": dict(aware=(True, 2129), bf16=(G, ()), fp8=(A, ()), view=True, cg=698, up=BOTH,
                   brk=False, bmm=False),
    "0.34.0": dict(aware=(True, 2555), bf16=(G, ()), fp8=(A, ()), view=True, cg=943, up=BOTH,
                   brk=False, bmm=False),
}
# The image applies the overlay where upstream's amd/mla.py lacks a fusion (0.27.1 ... 0.31.0,
# K3_OVERLAY=auto); a bare tree is a K3_OVERLAY=off build.
OVERLAY_APPLIED = ("0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0")


@pytest.fixture(scope="module", params=RELEASES)
def tree(request):
    """One release's real vLLM files."""
    return request.param, upstream_tree(request.param)


def image_facts(version, root):
    """The facts an image built FROM that release with K3_OVERLAY=auto records."""
    f = basefacts.measure(root)
    if version in OVERLAY_APPLIED:
        f["overlay_in_tree"] = basefacts.fact(True, "test: the image applied the overlay")
    return f


def test_facts_from_the_real_sources(tree):
    version, root = tree
    want = EXPECTED[version]
    f = basefacts.measure(root)
    print(version, json.dumps(f, indent=1))
    assert basefacts.value(f, "vllm_version") == version
    aware, line = want["aware"]
    assert basefacts.value(f, "gluon_decode_dtype_aware") is aware
    assert f"{basefacts.ROUTER}:{line} " in f["gluon_decode_dtype_aware"]["how"]
    assert basefacts.value(f, "quantizes_query") is True
    for key, dt in (("verify_route_bf16", "bf16"), ("verify_route_fp8", "fp8")):
        path, syncs = want[dt]
        assert basefacts.value(f, key) == {"route": path, "host_sync": bool(syncs)}, f[key]
        how = f[key]["how"]
        assert (f"host sync at line {', '.join(map(str, syncs))}" in how if syncs else
                "no host sync on that path" in how), how
    assert basefacts.value(f, "padded_query_view") is want["view"]
    assert basefacts.value(f, "decode_cudagraph_support") == "UNIFORM_BATCH"
    assert f"{basefacts.ROUTER}:{want['cg']} " in f["decode_cudagraph_support"]["how"]
    assert basefacts.value(f, "default_cudagraph_mode") == "FULL_AND_PIECEWISE"
    assert basefacts.value(f, "upstream_mla_fusions") == want["up"]
    assert basefacts.value(f, "upstream_mla_switchable") == want["up"]
    assert basefacts.value(f, "breakable_cudagraph_auto_for_k3") == {"rocm": want["brk"],
                                                                     "cuda": True}
    assert basefacts.value(f, "fp8_bmm_default") is want["bmm"]
    assert basefacts.value(f, "fp4_bmm_default") is want["bmm"]
    # the routes the render checks: fp8 KV at 12 heads/rank, decode and MTP k=2 verify
    r1, r3 = basefacts.route(f, 12, "fp8"), basefacts.route(f, 12, "fp8", 3)
    if version == "0.27.1":
        assert r1["route"] == "gluon" and r1["fp8_query_ok"] is False
        assert r3["fp8_query_ok"] is False and r3["host_sync"] is True
    else:
        assert (r1["route"], r1["fp8_query_ok"]) == ("asm-padded", True)
        assert (r3["route"], r3["fp8_query_ok"], r3["host_sync"]) == ("asm-padded", True, False)
    assert basefacts.route(f, 12, "auto", 3)["host_sync"] is (version in ("0.27.1", "0.28.0"))
    assert basefacts.route(f, 16, "fp8")["fp8_query_ok"] is True  # TP=6: asm, no padding


def test_the_verify_reading_is_behaviour_not_a_name(tmp_path):
    """0.28.0 has use_gluon_verify and still syncs the host on the bf16 verify; a tree whose
    verify branch is a test this reader does not know is 'unknown', not a guess."""
    root = upstream_tree("0.28.0")
    f = basefacts.measure(root)
    assert "use_gluon_verify:931 refuses a quantized KV cache" in f["verify_route_fp8"]["how"]
    src = (root / basefacts.ROUTER).read_text()
    odd = tmp_path / "vllm" / basefacts.ROUTER.removeprefix("vllm/")
    odd.parent.mkdir(parents=True)
    odd.write_text(src.replace("if decode.use_gluon_decode:", "if decode.some_new_gate:"))
    got = basefacts._router_facts(odd)
    assert got["verify_route_fp8"]["value"] is None
    assert "does not know" in got["verify_route_fp8"]["how"]
    assert basefacts.route({"verify_route_fp8": got["verify_route_fp8"]}, 12, "fp8",
                           3)["fp8_query_ok"] is None
    f.update(got)  # a base whose verify path is unknown: no refusal, no graph-mode change
    r = _render(f)
    assert "--compilation-config" not in r.argv and r.settings.kv_cache_dtype == "fp8"
    assert any("syncs the host is unknown" in n for n in r.base["notes"]), r.base["notes"]


def _render(facts, **env):
    return render(environ={"K3_MODEL": "/tmp", **env}, dotenv=None, base=facts)


def test_defaults_on_each_base(tree):
    version, root = tree
    f = image_facts(version, root)
    r = _render(f)
    notes = " | ".join(r.base["notes"])
    print(version, r.base)
    if version == "0.27.1":  # the seed nightly's release: what it cannot serve
        assert r.settings.kv_cache_dtype == "auto" and r.sources["K3_KV_CACHE_DTYPE"] == \
            "base facts"
        assert r.settings.fuse_decode_qprep is False and r.settings.fuse_qk_norm is True
        assert r.argv[r.argv.index("--kv-cache-dtype") + 1] == "auto"
        assert r.env["K3_FUSE_DECODE_QPREP"] == "0"
        cc = r.argv.index("--compilation-config")
        assert json.loads(r.argv[cc + 1]) == {"cudagraph_mode": "PIECEWISE"}
        assert "--speculative-config" in r.argv  # MTP k=2 stays
        assert "Gluon" in notes and "host sync at line 1164, 1185" in notes
    else:  # the target configuration: nothing re-defaulted, vLLM's own graph mode
        assert "base facts" not in r.sources.values(), r.sources
        assert (r.settings.kv_cache_dtype, r.settings.mtp_k) == ("fp8", 2)
        assert r.settings.fuse_qk_norm and r.settings.fuse_decode_qprep
        assert "--compilation-config" not in r.argv
    if EXPECTED[version]["up"] and version not in OVERLAY_APPLIED:
        assert "the k3rocm hook switches" in notes
    # MTP off, or graphs off: no graph-mode change
    assert "--compilation-config" not in _render(f, K3_MTP_K="0").argv
    assert "--compilation-config" not in _render(f, K3_ENFORCE_EAGER="1").argv
    # the user's own compilation config wins
    own = _render(f, K3_EXTRA_ARGS="--compilation-config '{\"cudagraph_mode\":\"NONE\"}'").argv
    assert own.count("--compilation-config") == 1
    # bf16 KV with MTP: 0.28.0's bf16 verify still syncs the host (PIECEWISE); 0.29+ do not
    bf16 = _render(f, K3_KV_CACHE_DTYPE="auto", K3_FUSE_DECODE_QPREP="0")
    assert ("--compilation-config" in bf16.argv) is (version in ("0.27.1", "0.28.0"))


def test_fusions_off_are_served_where_something_switches_them(tree):
    """K3_FUSE_*=0 is served where the overlay is applied or upstream's file has the fusion's
    attribute (the upstream hook); refused, naming the fix, only where neither holds."""
    version, root = tree
    f = image_facts(version, root)
    off = {"K3_FUSE_QK_NORM": "0", "K3_FUSE_DECODE_QPREP": "0"}
    r = _render(f, **off)
    assert (r.settings.fuse_qk_norm, r.settings.fuse_decode_qprep) == (False, False)
    assert r.env["K3_FUSE_QK_NORM"] == "0" and r.env["K3_FUSE_DECODE_QPREP"] == "0"
    if EXPECTED[version]["up"] and version not in OVERLAY_APPLIED:
        # run-time K3_OVERLAY=off disables the plugin, so nothing switches upstream's fusion
        with pytest.raises(UsageError) as e:
            _render(f, K3_OVERLAY="off", K3_FUSE_QK_NORM="0")
        line = str(e.value)
        assert line.startswith("K3_FUSE_QK_NORM=0 cannot take effect on this base")
        assert "K3_OVERLAY=off" in line and "unset K3_OVERLAY" in line and "\n" not in line
        # a base whose file lacks the attribute: no hook, so no off switch
        bare = {**f, "upstream_mla_switchable": basefacts.fact([], "test")}
        with pytest.raises(UsageError, match="without the per-layer attribute "
                           "_use_eager_qk_rmsnorm_fusion"):
            _render(bare, K3_FUSE_QK_NORM="0")
        assert _render(bare).settings.fuse_qk_norm is True  # on, as upstream ships it
    elif version in OVERLAY_APPLIED:  # the overlay, off at run time: no fusion at all
        r = _render(f, K3_OVERLAY="off")
        assert (r.settings.fuse_qk_norm, r.settings.fuse_decode_qprep) == (False, False)
        with pytest.raises(UsageError, match="K3_FUSE_QK_NORM=1 cannot take effect"):
            _render(f, K3_OVERLAY="off", K3_FUSE_QK_NORM="1")


def test_a_bare_tree_without_the_fusion_says_so():
    """0.30.0 ships the q/kv norm fusion only: a tree without the overlay (K3_OVERLAY=off build)
    cannot do Q-prep, so the default is turned off with the reason, and asking for it is
    refused with the fix (an auto build applies the overlay there)."""
    f = basefacts.measure(upstream_tree("0.30.0"))
    r = _render(f)
    assert r.settings.fuse_qk_norm is True and r.settings.fuse_decode_qprep is False
    assert any("does not ship it and the overlay is not in this image" in n
               for n in r.base["notes"])
    with pytest.raises(UsageError, match="K3_FUSE_DECODE_QPREP=1 cannot take effect.*"
                       "K3_OVERLAY=auto"):
        _render(f, K3_FUSE_DECODE_QPREP="1")


def test_refusals_name_the_setting_and_the_fix(tree):
    version, root = tree
    f = image_facts(version, root)
    if version == "0.27.1":
        with pytest.raises(UsageError) as e:
            _render(f, K3_KV_CACHE_DTYPE="fp8")
        line = str(e.value)
        print(line)
        assert line.startswith("K3_KV_CACHE_DTYPE=fp8 cannot serve on this base") and \
            "K3_KV_CACHE_DTYPE=auto" in line and "\n" not in line
        assert "vLLM >= 0.28.0" in line and basefacts.DEFAULT_BASE_IMAGE in line
        with pytest.raises(UsageError, match="K3_FUSE_DECODE_QPREP=1 needs an fp8 KV cache"):
            _render(f, K3_FUSE_DECODE_QPREP="1")
        with pytest.raises(UsageError, match="K3_KV_CACHE_DTYPE=fp8 cannot serve"):
            _render(f, K3_PROFILE="fusion-evidence")  # states the facts it needs
        warned = _render(f, K3_KV_CACHE_DTYPE="fp8", K3_BASE_CHECK="warn")
        assert warned.settings.kv_cache_dtype == "fp8"
        assert warned.base["notes"][0].startswith("WARNING (K3_BASE_CHECK=warn)")
        assert _render(f, K3_TP="6").settings.kv_cache_dtype == "fp8"  # 16 heads/rank: asm
    else:
        assert _render(f, K3_PROFILE="fusion-evidence").settings.kv_cache_dtype == "fp8"
        assert _render(f, K3_KV_CACHE_DTYPE="fp8").settings.kv_cache_dtype == "fp8"
    with pytest.raises(UsageError, match="K3_FUSE_DECODE_QPREP=1 needs an fp8 KV cache"):
        _render(f, K3_KV_CACHE_DTYPE="auto", K3_FUSE_DECODE_QPREP="1")


def test_unknown_facts_never_refuse():
    f = {"schema": 1, "vllm_version": basefacts.unknown("x")}
    r = _render(f, K3_KV_CACHE_DTYPE="fp8")
    assert r.settings.kv_cache_dtype == "fp8"
    assert any("unknown" in n for n in r.base["notes"])
    host = render(environ={"K3_MODEL": "/tmp"}, dotenv=None)
    assert "base" not in host.to_json()


def test_cli_prints_the_route():
    env = {"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, "-m", "k3rocm", "base", "facts"]
    p = subprocess.run([*cmd, "--json", "--site", str(upstream_tree("0.27.1"))],
                       capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    assert rep["heads"] == 12 and rep["routes"]["fp8 q1"]["route"] == "gluon"
    assert rep["routes"]["auto q3"]["host_sync"] is True
    bad = subprocess.run([*cmd, "--heads", "0"], capture_output=True, text=True, timeout=60,
                         env=env)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


def test_manifest_records_facts(tmp_path, monkeypatch):
    from k3rocm.serving import manifest

    m = manifest.build_manifest("base:x", "rev", tmp_path, None)
    assert "base_facts" in m and m["base_facts"]["schema"] == 1
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps({"base_facts": {"schema": 1, "vllm_version":
                                               basefacts.fact("9.9", "test")}}))
    facts, where = basefacts.load(Path(path))
    assert basefacts.value(facts, "vllm_version") == "9.9" and "image build" in where


def test_serve_writes_what_it_rendered_for_the_checks(tmp_path):
    """`k3rocm serve` records its rendering (after the base facts) before exec'ing vLLM; the
    census's claim and provenance read that file, not the container's raw env, so a default
    the base switched off is not "asked ON"."""
    import os
    import stat

    fake = tmp_path / "bin" / "vllm"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\ncat "$K3_RENDERED_FILE"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "rendered.json"
    env = {"PATH": f"{fake.parent}:/usr/bin:/bin", "PYTHONPATH": str(REPO / "src"),
           "K3_RENDERED_FILE": str(out), "K3_MODEL": "/tmp", "K3_API_KEY": "sekret",
           "K3_FUSE_QK_NORM": "0", "HOME": os.environ.get("HOME", "/root")}
    p = subprocess.run([sys.executable, "-m", "k3rocm", "serve"], env=env, capture_output=True,
                       text=True, timeout=60, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    rec = json.loads(p.stdout)
    assert rec == json.loads(out.read_text())
    assert rec["env"]["K3_FUSE_QK_NORM"] == "0" and rec["env"]["K3_FUSE_DECODE_QPREP"] == "1"
    assert "sekret" not in out.read_text()  # redacted
    assert rec["argv"][:2] == ["vllm", "serve"]


@pytest.mark.parametrize("tag,clamps", [("v0.1.19", False), ("v0.1.19.post1", True)])
def test_aiter_clamp_fact_from_the_stub(tag, clamps):
    """The static reading of AITER's Q-prep stub, against its signature at the two tags (the
    registered schema is defined from it; the run-time probe reads the schema itself)."""
    f = basefacts.measure(None, REPO / "tests" / "data" / "aiter-stubs" / tag)
    assert basefacts.value(f, "aiter_qprep_clamp") is clamps, f["aiter_qprep_clamp"]
    assert ("has" if clamps else "lacks") + " compute_all_q_rope" in f["aiter_qprep_clamp"]["how"]


def test_the_default_base_is_named_once():
    """Dockerfile, compose.yaml and the stand-in tags name the default base and the seed
    nightly as basefacts does."""
    from k3rocm.dev.standin import ROCM_NAMES

    assert f"ARG BASE_IMAGE={basefacts.DEFAULT_BASE_IMAGE}\n" in (REPO / "Dockerfile").read_text()
    assert f"BASE_IMAGE: ${{BASE_IMAGE:-{basefacts.DEFAULT_BASE_IMAGE}}}" in \
        (REPO / "compose.yaml").read_text()
    assert basefacts.DEFAULT_BASE_IMAGE == "vllm/vllm-openai-rocm:v0.34.0"
    assert ROCM_NAMES == {"0.27.1": basefacts.SEED_BASE_IMAGE,
                          "0.32.0": basefacts.DEFAULT_BASE_IMAGE}
    assert "STANDIN_TAG_ROCM ?= 0.32.0 0.27.1" in (REPO / "mk" / "standin.mk").read_text()


@pytest.mark.parametrize("ref,given,want", [
    ("vllm/vllm-openai-rocm:v0.34.0", "vllm/vllm-openai-rocm@sha256:" + "a" * 64,
     "vllm/vllm-openai-rocm@sha256:" + "a" * 64),
    ("vllm/vllm-openai-rocm@sha256:" + "b" * 64, "", "vllm/vllm-openai-rocm@sha256:" + "b" * 64),
    ("vllm/vllm-openai-rocm:v0.34.0", "", "unknown (built from a local tag)"),
    # a digest of another repository (a stale BASE_DIGEST) is not this base's
    ("k3rocm/standin:vllm-cpu-0.32.0", "vllm/vllm-openai-rocm@sha256:" + "a" * 64,
     "unknown (built from a local tag)"),
])
def test_manifest_records_the_base_digest(tmp_path, ref, given, want):
    from k3rocm.serving import manifest

    assert manifest.build_manifest(ref, "rev", tmp_path, None, given)["base_digest"] == want


def test_the_seed_profile_on_the_seed_base():
    """seed-nightly on the seed's facts keeps the seed's values and re-defaults what that base
    cannot serve (the default profile on 0.34.0: test_config_render's golden, unchanged by the
    base per test_the_base_changes_only_what_config_says_it_decides)."""
    seed = _render(image_facts("0.27.1", upstream_tree("0.27.1")), K3_PROFILE="seed-nightly")
    a = seed.argv
    assert a[a.index("--kv-cache-dtype") + 1] == "auto"
    assert a[a.index("--max-num-seqs") + 1] == "64"
    assert a[a.index("--load-format") + 1] == "fastsafetensors"
    assert json.loads(a[a.index("--compilation-config") + 1]) == {"cudagraph_mode": "PIECEWISE"}
    assert seed.env["K3_FUSE_DECODE_QPREP"] == "0" and seed.env["K3_FUSE_QK_NORM"] == "1"


def test_a_tool_with_its_own_base_does_not_inherit_the_shells_digest(monkeypatch):
    """make exports BASE_DIGEST for the shell's BASE_IMAGE; a tool that builds FROM its own base
    (smoke: inherit_env=False) must not hand that digest to its build."""
    from k3rocm.deploy.lifecycle import ComposeServer

    monkeypatch.setenv("BASE_IMAGE", basefacts.SEED_BASE_IMAGE)
    monkeypatch.setenv("BASE_DIGEST", "vllm/vllm-openai-rocm@sha256:" + "c" * 64)
    own = ComposeServer(project="k3bf-x", cpu=True, inherit_env=False,
                        env={"BASE_IMAGE": "k3rocm/standin:vllm-cpu-0.32.0"}).compose_env()
    assert "BASE_DIGEST" not in own and own["BASE_IMAGE"] == "k3rocm/standin:vllm-cpu-0.32.0"
    assert "BASE_DIGEST" in ComposeServer(project="k3bf-y", cpu=True).compose_env()
