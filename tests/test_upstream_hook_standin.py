"""The upstream hook inside REAL vLLM: tests/overlay_invllm/hook_cases.py in the 0.32.0 CPU
stand-in on its own amd/mla.py, and on the real 0.33.0 and 0.34.0 files copied over it (where
Q-prep's followers exist). Served end to end: test_census_standin.py's hook census-ab.
"""

from __future__ import annotations

import json
import re

import pytest
from conftest import upstream_tree
from overlay_docker import SITE, require_standin, run_in_standin

pytestmark = pytest.mark.docker

SCRIPT = r"""
for V in 0.32.0 0.34.0 0.33.0; do
  [ $V = 0.32.0 ] || cp /upstream/$V/mla.py {site}/vllm/models/kimi_k3/amd/mla.py
  rm -rf /tmp/traces
  PYTHONPATH=/tmp/k3/tests/doubles K3_TEST_DOUBLE_ROCM=1 K3_PROFILER_DIR=/tmp/traces \
      python3 tests/overlay_invllm/hook_cases.py $V > /tmp/$V.log 2>&1 \
      || { echo "FAILED $V"; tail -40 /tmp/$V.log; exit 1; }
  grep "^CASE " /tmp/$V.log | sed "s/^CASE /CASE $V /"
done
"""


def _cases(log: str) -> dict[str, dict[str, dict]]:
    out: dict[str, dict[str, dict]] = {}
    for m in re.finditer(r"^CASE (\S+) (\{.*\})$", log, re.M):
        case = json.loads(m.group(2))
        out.setdefault(m.group(1), {})[case["case"]] = case
    return out


@pytest.fixture(scope="module")
def cases(docker_client):
    image = require_standin(docker_client, "0.32.0")
    volumes = {str(upstream_tree(v) / "vllm/models/kimi_k3/amd/mla.py"):
               {"bind": f"/upstream/{v}/mla.py", "mode": "ro"} for v in ("0.33.0", "0.34.0")}
    rc, log = run_in_standin(docker_client, image, SCRIPT.replace("{site}", SITE),
                             timeout=1500, volumes=volumes)
    print(log[-8000:])
    assert rc == 0, log[-5000:]
    res = _cases(log)
    assert set(res) == {"0.32.0", "0.33.0", "0.34.0"}, log[-3000:]
    return res


def _rec(case: dict) -> dict:
    [rec] = case["records"]  # one record per process and layer kind for this decision
    assert rec["writer"] == "upstream" and rec["phase"] == "construct"
    assert rec["layer_kind"] == "target"
    return rec


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0", "0.34.0"])
def test_qk_norm_asked_on_and_off(cases, version):
    c = cases[version]
    s = c["summary"]
    assert s["hook_state"] is True and s["init_wrapped"] is True
    assert s["file"] == f"{SITE}/vllm/models/kimi_k3/amd/mla.py"
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


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0", "0.34.0"])
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


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0", "0.34.0"])
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
