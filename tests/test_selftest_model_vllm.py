"""vLLM 0.27.1's Kimi-K3 code (stand-in image) builds the AMD KimiLinearForCausalLM and KimiK3MTP
on the CPU and loads every tensor of the slicer's output (tests/overlay_invllm/slice_load.py).
Kernel choice, TP sharding and a forward pass are the node's `make selftest`'s to show.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from kimi_k3_layout import write_checkpoint
from overlay_docker import require_standin, run_container

from k3rocm import cli

pytestmark = pytest.mark.docker
HELPERS = Path(__file__).resolve().parent / "overlay_invllm"


def _load_in_vllm(client, image: str, slice_dir: Path) -> tuple[int, str]:
    return run_container(client, image, "python3 /k3tests/slice_load.py /slice", timeout=600,
                         volumes={str(HELPERS): {"bind": "/k3tests", "mode": "ro"},
                                  str(slice_dir): {"bind": "/slice", "mode": "ro"}})


def test_vllm_kimi_k3_loads_the_slice(docker_client, tmp_path):
    image = require_standin(docker_client, "0.27.1")
    write_checkpoint(tmp_path / "src")
    out = tmp_path / "slice"
    assert cli.main(["selftest", "model", str(tmp_path / "src"), str(out)]) == 0
    tc = json.loads((out / "config.json").read_text())["text_config"]
    rc, log = _load_in_vllm(docker_client, image, out)
    m = re.findall(r"^RESULT (\{.*\})$", log, re.M)
    assert rc == 0 and m, log[-4000:]
    r = json.loads(m[-1])
    assert r["hf_config"] == "KimiK3Config" and r["text_config"] == "KimiLinearConfig"
    assert r["quant"] == "Mxfp4Config"  # the MXFP4 quantization_config is read as such
    # every parameter of the AMD text model is loaded from the slice, nothing left over
    assert r["text"]["not_loaded"] == [] and r["text"]["loaded"] == r["text"]["params"]
    # the MTP draft loads its layer; its embedding is the target's (vLLM 0.27.1
    # v1/spec_decode/llm_base_proposer.py:1474-1480: an MTP model always shares it)
    assert r["mtp"]["not_loaded"] == ["model.embed_tokens.weight"]
    # routed experts as the MXFP4 MoE method allocates them, at the latent width
    # (routed_expert_hidden_size): [experts, 2*inter, latent/2] ...
    k, h, inter = tc["num_experts"], tc["routed_expert_hidden_size"], tc["moe_intermediate_size"]
    assert h < tc["hidden_size"]
    shapes = r["text"]["shapes"]
    w = "model.layers.3.block_sparse_moe.experts.routed_experts."
    assert shapes[w + "w13_weight"] == [k, 2 * inter, h // 2]
    assert shapes[w + "w13_weight_scale"] == [k, 2 * inter, h // 32]
    assert shapes[w + "w2_weight"] == [k, h, inter // 2]
    assert sorted({n.split(".")[2] for n in shapes}) == ["1", "2", "3"]  # layer 0 is dense
    assert any(".layers.4.mtp_block." in n for n in r["mtp"]["shapes"])
    assert r["unused"] == ["mm_projector.proj.0.weight"]  # vision side, not built here

    # the check can fail: a config that disagrees with the tensors (router cut to k rows)
    cfg = json.loads((out / "config.json").read_text())
    cfg["text_config"]["num_experts"] = k + 1
    (out / "config.json").write_text(json.dumps(cfg))
    rc, log = _load_in_vllm(docker_client, image, out)
    assert rc != 0 and not re.search(r"^RESULT ", log, re.M), log[-4000:]
    assert f"Attempted to load weight (torch.Size([{k}]))" in log, log[-4000:]
