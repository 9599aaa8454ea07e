"""The overlay in the real serving image (the repository's Dockerfile): FROM the 0.27.1 stand-in
the build applies it and vLLM's plugin loader makes the AMD Kimi-K3 attention build our wrapper;
FROM the 0.32.0 stand-in it is skipped (auto: upstream's class is built) or forced.
"""

from __future__ import annotations

import hashlib
import json
import re
import textwrap

import pytest
from conftest import REPO, build_server_image
from overlay_docker import SITE, require_standin, run_container, sections

from k3rocm.serving.decisions import parse_line

pytestmark = pytest.mark.docker

MLA_FILE = REPO / "overlay/vllm/models/kimi_k3/amd/mla.py"


def build(client, base: str, tag: str, mode: str) -> str:
    """Build the real Dockerfile with K3_OVERLAY=mode (fails the test if it fails); its log."""
    log: list[str] = []
    build_server_image(client, base, tag, log=log, K3_OVERLAY=mode)
    return "".join(log)


def said(log: str, rep: dict, line: str) -> None:
    """The build printed `line`, or the step came from the layer cache and the report
    written by that same step records it."""
    assert rep["message"].startswith(line), rep
    assert line in log or "Using cache" in log, log[-3000:]


HELPERS = REPO / "tests" / "overlay_invllm"  # mla_cpu (test helper, never in the image)


def run_py(client, image: str, *steps: str | tuple[str, dict]) -> list[str]:
    """Each step (python code, or (code, env)) in its own python3 process, in order, in one
    container; return each step's output."""
    script = "set -e\n"
    for i, step in enumerate(steps):
        code, env = step if isinstance(step, tuple) else (step, {})
        script += (f'echo "=== {i}"\n' + "".join(f"{k}={v} " for k, v in env.items())
                   + f"python3 - <<'K3PY'\n{code}\nK3PY\n")
    rc, log = run_container(client, image, script, timeout=600,
                            volumes={str(HELPERS): {"bind": "/k3tests", "mode": "ro"}})
    assert rc == 0, log[-3000:]
    out = sections(log)
    return [out[str(i)] for i in range(len(steps))]


REPORT_STATUS = """
import json
from k3rocm.serving.overlay import status
print("REPORT " + json.dumps(json.load(open("/opt/k3rocm/overlay.json"))))
print("STATUS " + json.dumps(status()))
"""

WIRING = textwrap.dedent("""
    import json, sys, torch
    sys.path.insert(0, "/k3tests")
    import mla_cpu
    from vllm.plugins import load_general_plugins
    load_general_plugins()                      # vLLM's own loader -> our entry point
    kimi_before = sorted(m for m in sys.modules if m.startswith("vllm.models.kimi_k3"))
    import vllm.models.kimi_k3.amd.linear as lin
    from vllm.transformers_utils.configs.kimi_linear import KimiLinearConfig
    with mla_cpu.vllm_cpu_context():
        torch.set_default_dtype(torch.bfloat16)
        a = lin.KimiMLAAttention(KimiLinearConfig(), hidden_size=256, num_heads=16,
            qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=128,
            kv_lora_rank=512, use_nope=True, prefix="model.layers.0.self_attn")
    w = a.mla_attn
    quant = getattr(a, "get_input_quant_key", None)  # vLLM 0.32: asks the wrapper
    print("RESULT " + json.dumps({"class": type(w).__name__, "module": type(w).__module__,
                                  "ours": getattr(sys.modules[type(w).__module__],
                                                  "K3ROCM_OVERLAY", 0),
                                  "quant_key": repr(quant()) if quant else None,
                                  "kimi_before": kimi_before,
                                  "qprep_why": getattr(w, "_fused_qk_prep_why", None)}))
""")


def _result(out: str, key: str = "RESULT") -> dict:
    m = re.findall(rf"^{key} (\{{.*\}})$", out, re.M)
    assert m, out[-3000:]
    return json.loads(m[-1])


def test_image_on_nightly_era_base_applies_and_wires(docker_client):
    base = require_standin(docker_client, "0.27.1")
    log = build(docker_client, base, "k3rocm/server:cpu-0.27.1", "auto")
    # K3_OVERLAY=off at run time (the last step): the plugin stays out, the stock wrapper
    first, out, off = run_py(docker_client, "k3rocm/server:cpu-0.27.1", REPORT_STATUS, WIRING,
                             (WIRING, {"K3_OVERLAY": "off"}))
    rep, st = _result(first, "REPORT"), _result(first, "STATUS")
    said(log, rep, "overlay: applied 1 files (vLLM has no amd/mla.py)")
    assert rep["decision"] == "applied" and rep["vllm_version"] == "0.27.1"
    assert rep["vllm_path"] == f"{SITE}/vllm"
    assert rep["files"][0]["sha256"] == hashlib.sha256(MLA_FILE.read_bytes()).hexdigest()
    assert st["verified"] is True and st["plugin_registered"] is True
    assert st["amd_mla"] == "k3rocm overlay"
    res = _result(out)
    assert res["class"] == "KimiK3MultiHeadLatentAttentionWrapper"
    assert res["module"] == "vllm.models.kimi_k3.amd.mla"
    assert res["qprep_why"] == "platform is not ROCm"
    assert res["kimi_before"] == []  # the plugin imports nothing of Kimi-K3 by itself
    recs = [r for r in map(parse_line, out.splitlines()) if r]
    assert [(r["layer_kind"], r["phase"]) for r in recs] == [("target", "construct")], out
    assert recs[0]["fusions"]["decode_qprep"] == {"state": "off",
                                                  "reason": "platform is not ROCm"}
    assert _result(off)["class"] == "MultiHeadLatentAttentionWrapper"


def test_image_on_upstream_base_skips_unless_forced(docker_client):
    base = require_standin(docker_client, "0.32.0")
    log = build(docker_client, base, "k3rocm/server:cpu-0.32.0", "auto")
    first, out = run_py(docker_client, "k3rocm/server:cpu-0.32.0", REPORT_STATUS, WIRING)
    rep, st = _result(first, "REPORT"), _result(first, "STATUS")
    said(log, rep, "overlay: skipped, upstream amd/mla.py ships qk_norm and decode_qprep; "
                   "switchable through the plugin's upstream hook")
    assert rep["decision"] == "skipped-upstream" and rep["vllm_version"] == "0.32.0"
    assert rep["upstream_fusions"] == ["qk_norm", "decode_qprep"]
    assert st["healthy"] is True and st["overlay"].startswith("skipped: upstream amd/mla.py")
    # upstream's amd/linear.py (0.30+) builds the class from amd/mla.py by name: the skipped
    # image builds upstream's, the forced one (below) ours, with 0.32's get_input_quant_key
    # answered
    res = _result(out)
    assert res["class"] == "KimiK3MultiHeadLatentAttentionWrapper" and res["ours"] == 0
    log = build(docker_client, base, "k3rocm/overlay-test:cpu-0.32.0-force", "force")
    first, out = run_py(docker_client, "k3rocm/overlay-test:cpu-0.32.0-force", REPORT_STATUS,
                        WIRING)
    rep = _result(first, "REPORT")
    said(log, rep, "overlay: applied 1 files (forced over upstream amd/mla.py")
    assert rep["decision"] == "forced" and rep["upstream_backup"]["path"].endswith(
        "mla.py.k3rocm-upstream")
    res = _result(out)
    assert res["class"] == "KimiK3MultiHeadLatentAttentionWrapper" and res["ours"] == 1
    assert res["module"] == "vllm.models.kimi_k3.amd.mla" and res["quant_key"] == "None"
    assert res["qprep_why"] == "platform is not ROCm"
