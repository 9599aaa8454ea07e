"""REAL vLLM in the CPU stand-ins, one container per stand-in, in this order:
- ``layout``: the image as built, laid out like the ROCm image (image config: test_standin.py);
- ``alone`` (0.27.1): the overlay file alone under vLLM's amd/, nothing of ours installed;
- ``invllm``: k3rocm installed, ``overlay apply --mode auto`` (0.27.1: applied; 0.32.0: skipped,
  upstream's amd/mla.py), then tests/overlay_invllm under pytest;
- ``hook`` (0.32.0): the upstream hook (tests/overlay_invllm/hook_cases.py) on 0.32.0's own
  amd/mla.py and on the real 0.33.0 and 0.34.0 files copied over it.
Served end to end: test_census_standin.py's census-ab (through the upstream hook).
"""

from __future__ import annotations

import functools
import json
import re

import pytest
from conftest import upstream_tree
from overlay_docker import SITE, require_standin, run_in_standin, sections

pytestmark = pytest.mark.docker
AMD_MLA = f"{SITE}/vllm/models/kimi_k3/amd/mla.py"

LAYOUT_PY = """
import os, vllm
print("VLLMDIR", os.path.dirname(vllm.__file__))
import vllm.models.kimi_k3.amd.linear
print("KIMI_LINEAR_OK", flush=True)
"""

# The one file, put at vLLM's amd/mla.py of the nightly-era stand-in where k3rocm is not
# installed (mla_cpu.py, the test's layer builder, from the repo mount); removed after.
ALONE_PY = """
print("=== alone", flush=True)
import importlib, importlib.util, json, shutil, sys
assert importlib.util.find_spec("k3rocm") is None, "k3rocm is installed here"
sys.path.insert(0, "/repo/tests/overlay_invllm")
import torch
import mla_cpu
from vllm.model_executor.layers.mla import MultiHeadLatentAttentionWrapper as Stock

shutil.copy("/repo/overlay/vllm/models/kimi_k3/amd/mla.py",
            os.path.join(os.path.dirname(vllm.__file__), "models/kimi_k3/amd/mla.py"))
importlib.invalidate_caches()
import vllm.models.kimi_k3.amd.mla as m
outs = {}
with mla_cpu.vllm_cpu_context():
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    for name, cls in (("ours", m.KimiK3MultiHeadLatentAttentionWrapper), ("stock", Stock)):
        w = mla_cpu.build_wrapper(cls, heads=4, seed=3)
        outs[name] = mla_cpu.profile_forward(w, x)
d = os.environ["K3_PROFILER_DIR"]
files = sorted(os.listdir(d))
print("ALONE " + json.dumps({
    "vllm": vllm.__version__, "file": m.__file__, "marker": m.K3ROCM_OVERLAY,
    "shape": list(outs["ours"].shape), "same": bool(torch.equal(outs["ours"], outs["stock"])),
    "files": files, "records": json.load(open(os.path.join(d, files[0])))}))
"""

INVLLM = """
echo "=== invllm"
python3 -m k3rocm overlay apply --overlay-dir /tmp/k3/overlay --mode auto \
    --report /tmp/overlay.json
python3 -m pytest -q -p no:cacheprovider -o python_files='check_*.py' -rA --durations=12 \
    tests/overlay_invllm || echo "PYTEST FAILED"
"""

HOOK = f"""
echo "=== hook"
for V in 0.32.0 0.34.0 0.33.0; do
  [ $V = 0.32.0 ] || cp /upstream/$V/mla.py {AMD_MLA}
  rm -rf /tmp/traces
  PYTHONPATH=/tmp/k3/tests/doubles K3_TEST_DOUBLE_ROCM=1 K3_PROFILER_DIR=/tmp/traces \\
      python3 tests/overlay_invllm/hook_cases.py $V > /tmp/$V.log 2>&1 \\
      || {{ echo "FAILED $V"; tail -40 /tmp/$V.log; exit 1; }}
  grep "^CASE " /tmp/$V.log | sed "s/^CASE /CASE $V /"
done
"""


def _run(client, version: str) -> dict[str, str]:
    alone = version == "0.27.1"  # ALONE_PY goes on in LAYOUT_PY's process (vllm, os)
    before = ('echo "=== layout"; pwd; cat /app/versions.txt; vllm --version\n'
              "TORCHDYNAMO_DISABLE=1 K3_PROFILER_DIR=/tmp/traces PYTHONDONTWRITEBYTECODE=1 "
              "python3 - <<'K3PY'\n" + LAYOUT_PY + (ALONE_PY if alone else "") + "K3PY\n"
              + (f"rm -f {AMD_MLA}\n" if alone else ""))
    volumes = {} if alone else {
        str(upstream_tree(v) / "vllm/models/kimi_k3/amd/mla.py"):
        {"bind": f"/upstream/{v}/mla.py", "mode": "ro"} for v in ("0.33.0", "0.34.0")}
    rc, log = run_in_standin(client, require_standin(client, version),
                             INVLLM + ("" if alone else HOOK), before=before,
                             volumes=volumes, timeout=1800)
    print(f"--- stand-in {version}: exit {rc}\n{log[-8000:]}")
    return {"rc": str(rc), "log": log, **sections(log)}


@pytest.fixture(scope="module")
def standin(docker_client):
    """standin(version): the parts of that stand-in's one container run."""
    return functools.cache(functools.partial(_run, docker_client))


def _section(run: dict[str, str], name: str) -> str:
    assert name in run, f"no '{name}' part: exit {run['rc']}\n{run['log'][-4000:]}"
    return run[name]


@pytest.mark.parametrize("version", ["0.32.0", "0.27.1"])
def test_standin_layout_like_rocm(standin, version):
    """As built: WORKDIR /app, /app/versions.txt, the `vllm` command works (metadata shim),
    vLLM importable by python3 from the system site, kimi_k3 amd/linear.py importable
    (compressed-tensors)."""
    out = _section(standin(version), "layout")
    lines = out.strip().splitlines()
    assert lines[0] == "/app", out[-3000:]
    assert f"vllm: {version}+cpu" in lines and f"vllm-cpu: {version}" in lines
    assert "torch: 2.13.0+cpu" in lines
    assert f"{version}+cpu" in lines  # `vllm --version`
    assert f"VLLMDIR {SITE}/vllm" in lines and "KIMI_LINEAR_OK" in lines, out[-3000:]


@pytest.mark.parametrize("version,expect_line", [
    ("0.27.1", "overlay: applied 1 files (vLLM has no amd/mla.py)"),
    ("0.32.0", "overlay: skipped, upstream amd/mla.py ships qk_norm and decode_qprep"),
])
def test_wrapper_in_real_vllm(standin, version, expect_line):
    log = _section(standin(version), "invllm")
    assert expect_line in log, log[-4000:]
    summary = [ln for ln in log.splitlines() if re.search(r"\d+ passed", ln)]
    assert summary and "PYTEST FAILED" not in log, log[-4000:]
    assert "failed" not in summary[-1] and "error" not in summary[-1]
    assert f"vLLM {version}: " in log  # the construction test ran on this vLLM
    # the CLI probes run where the overlay is applied (check_overlay_wrapper's where_applied)
    assert len(re.findall(r"^PASSED \S+::test_probe_cli", log, re.M)) == (
        3 if version == "0.27.1" else 0), log[-4000:]


def test_overlay_file_alone_in_the_standin(standin):
    """The one file under vllm/models/kimi_k3/amd/ of the nightly-era stand-in without k3rocm:
    it imports, builds the wrapper from real vLLM layers, runs a forward (the stock branches
    on CPU: same output as vLLM's own wrapper) and writes its decision records to the log and
    beside the traces, in the format k3rocm's reader takes."""
    from k3rocm.serving import decisions

    log = _section(standin("0.27.1"), "alone")
    found = re.findall(r"^ALONE (\{.*\})$", log, re.M)
    assert found, log[-4000:]
    res = json.loads(found[-1])
    assert res["vllm"] == "0.27.1" and res["marker"] == 1
    assert res["file"] == AMD_MLA
    assert res["shape"] == [2, 256] and res["same"] is True
    assert res["files"] == [f"k3rocm-decisions-pid{res['records'][0]['pid']}.json"]
    # k3rocm's reader, on what the file wrote
    recs = [decisions.parse_record(r, f"record {i}") for i, r in enumerate(res["records"])]
    assert [(r.layer_kind, r.phase) for r in recs] == [("target", "construct")]
    assert recs[0].states == {"qk_norm": "off", "decode_qprep": "off"}
    assert recs[0].reasons["decode_qprep"] == "platform is not ROCm"
    assert "AITER not enabled" in recs[0].reasons["qk_norm"]
    logged = [r for r in map(decisions.parse_line, log.splitlines()) if r]
    assert logged == res["records"]


# ------------------------------------------------------- the upstream hook (0.32.0's container)


@pytest.fixture(scope="module")
def cases(standin) -> dict[str, dict[str, dict]]:
    run = standin("0.32.0")
    log = _section(run, "hook")
    assert run["rc"] == "0", log[-5000:]
    out: dict[str, dict[str, dict]] = {}
    for m in re.finditer(r"^CASE (\S+) (\{.*\})$", log, re.M):
        case = json.loads(m.group(2))
        out.setdefault(m.group(1), {})[case["case"]] = case
    assert set(out) == {"0.32.0", "0.33.0", "0.34.0"}, log[-3000:]
    return out


def _rec(case: dict) -> dict:
    [rec] = case["records"]  # one record per process and layer kind for this decision
    assert rec["writer"] == "upstream" and rec["phase"] == "construct"
    assert rec["layer_kind"] == "target"
    return rec


HOOK_FILES = pytest.mark.parametrize("version", ["0.32.0", "0.33.0", "0.34.0"])


@HOOK_FILES
def test_qk_norm_asked_on_and_off(cases, version):
    c = cases[version]
    s = c["summary"]
    assert s["hook_state"] is True and s["init_wrapped"] is True
    assert s["file"] == AMD_MLA
    on, off = c["qk_on"], c["qk_off"]
    # asked on: upstream's gate (AITER enabled, by the ROCm double) says on; the fused op runs
    assert on["attrs"]["_use_eager_qk_rmsnorm_fusion"] is True
    r = _rec(on)
    assert r["asked"] == {"qk_norm": True, "decode_qprep": True}
    assert r["fusions"]["qk_norm"] == {"state": "on", "reason": "upstream's gates: on"}
    assert r["fusions"]["decode_qprep"] == {"state": "off", "reason": "upstream's gates: off"}
    # asked off: the attribute really is False, the record says so, the stock norms ran
    assert off["attrs"]["_use_eager_qk_rmsnorm_fusion"] is False
    r = _rec(off)
    assert r["asked"]["qk_norm"] is False
    assert r["fusions"]["qk_norm"] == {"state": "off", "reason": "K3_FUSE_QK_NORM=0 (hook)"}
    if version == "0.32.0":  # the real forward runs on this vLLM (0.33/0.34 need their API)
        assert on["fused_norm_calls_in_forward"] == 1
        assert off["fused_norm_calls_in_forward"] == 0


@HOOK_FILES
def test_qprep_forced_on_then_asked_off_takes_its_followers(cases, version):
    c = cases[version]
    on, off = c["qprep_forced_on"], c["qprep_forced_off"]
    assert on["attrs"]["_fused_qk_prep"] is True
    assert _rec(on)["fusions"]["decode_qprep"] == {"state": "on",
                                                   "reason": "upstream's gates: on"}
    assert off["attrs"]["_fused_qk_prep"] is False
    assert _rec(off)["fusions"]["decode_qprep"] == {"state": "off",
                                                    "reason": "K3_FUSE_DECODE_QPREP=0 (hook)"}
    if version == "0.34.0":
        # upstream built the fold flag and the zero-position buffer for Q-prep ...
        assert on["attrs"]["_fold_qb_uk"] is True and on["attrs"]["_zero_positions"] == "Tensor"
        assert on["refilled"] == ["_w_fold"]  # its process_weights_after_loading folds
        # ... and with Q-prep asked off neither is left, and no folded weight is built
        assert off["attrs"]["_fold_qb_uk"] is False and off["attrs"]["_zero_positions"] is None
        assert off["refilled"] == [] and off["attrs_after_load"]["_w_fold"] is None
    else:
        assert "_fold_qb_uk" not in off["attrs"] and "_zero_positions" not in off["attrs"]


@HOOK_FILES
def test_an_attribute_not_a_bool_is_unknown_and_left_alone(cases, version):
    c = cases[version]
    odd = c["odd_norm_asked_off"]
    r = _rec(odd)
    assert r["fusions"]["qk_norm"]["state"] == "unknown"
    assert "_use_eager_qk_rmsnorm_fusion = int 1, not a bool" in r["fusions"]["qk_norm"]["reason"]
    assert r["fusions"]["decode_qprep"]["state"] == "off"  # the other fusion still judged
    assert odd["warnings"] == 1  # this layer's; none before (every other case: 0)
    assert not any(x["warnings"] for k, x in c.items() if k not in ("odd_norm_asked_off",
                                                                     "summary"))
    warnings = c["summary"]["warnings"]
    assert len(warnings) == 1 and "K3_FUSE_QK_NORM not switchable" in warnings[0]
    if version == "0.32.0":  # behaviour untouched: asked off, upstream's fused norm still ran
        assert odd["fused_norm_calls_in_forward"] == 1


def test_records_beside_the_traces_equal_the_log(cases):
    for version, c in cases.items():
        s = c["summary"]
        assert len(s["files"]) == 1 and re.fullmatch(r"k3rocm-decisions-pid\d+\.json",
                                                     s["files"][0]), version
        assert s["file_equals_log"] is True, version
