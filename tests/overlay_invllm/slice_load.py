"""TEST HELPER (runs inside the vLLM stand-in image): does vLLM's Kimi-K3 code accept a slice?

``python3 slice_load.py <slice dir>`` prints ``RESULT {json}``. Steps, all with the installed
vLLM's own code:

1. ``ModelConfig(model=<slice>)``: vLLM's config registry reads config.json into its
   ``KimiK3Config`` (``vllm/transformers_utils/configs/kimi_k3.py``) and the
   ``quantization_config`` into its compressed-tensors config.
2. Build the **AMD** text model ``vllm.models.kimi_k3.amd.linear.KimiLinearForCausalLM`` and MTP
   model ``vllm.models.kimi_k3.amd.mtp.KimiK3MTP`` (the classes a ROCm node uses; on CPU
   ``vllm/models/kimi_k3/__init__.py`` would pick the NVIDIA tree) under the slice's
   ``VllmConfig``, on the CPU, in a world-size-1 gloo group.
3. Feed every tensor of the slice (through its index) to their ``load_weights``: the text model
   gets the names mapped as ``KimiK3ForConditionalGeneration.hf_to_vllm_mapper`` maps them
   (``amd/model.py:69-75``) with the ``language_model.`` prefix its ``AutoWeightsLoader``
   strips; the MTP model gets the raw names (it strips the prefix itself, ``amd/mtp.py``).
   Every parameter must be loaded; a name the loaders do not know raises.

MLA attention backends: vLLM's CPU platform refuses MLA, so ``mla_cpu`` hands out the real
Triton MLA backend class (never run here). The vision tower is not built (the profile serves
``--language-model-only``).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402


def tensors(d: str):
    from safetensors import safe_open

    with open(os.path.join(d, "model.safetensors.index.json")) as fh:
        index = json.load(fh)
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(os.path.join(d, shard), framework="pt") as f:
            for k in f.keys():  # noqa: SIM118
                yield k, f.get_tensor(k)


def _patch_moe_backend() -> None:
    """No MXFP4 MoE kernel runs on a CPU (vLLM 0.27.1 ``fused_moe/oracle/mxfp4.py``: every
    backend refuses, EMULATION included), and the node's choice (``AITER_MXFP4_BF16`` for
    Kimi-K3's SiTU experts on gfx950, ``quantization/mxfp4.py`` ``_use_k3_situ_aiter``) needs
    AITER. Weights are only built and loaded here, never run: take EMULATION's layout (the
    OCP MX block alignment, 32)."""
    import vllm.model_executor.layers.quantization.mxfp4 as mx
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend

    mx.select_deepseek_v4_mxfp4_moe_backend = lambda moe: (Mxfp4MoeBackend.EMULATION, None)


def main(d: str) -> dict:
    import mla_cpu
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    mla_cpu._patch_platform()
    _patch_moe_backend()
    mc = ModelConfig(model=d, tokenizer=d, dtype="bfloat16", trust_remote_code=False,
                     skip_tokenizer_init=True, language_model_only=True)
    vc = VllmConfig(model_config=mc)
    out: dict = {"hf_config": type(mc.hf_config).__name__,
                 "text_config": type(mc.hf_text_config).__name__,
                 "architectures": mc.architectures,
                 "quant": type(vc.quant_config).__name__ if vc.quant_config else None}
    text_vc = vc.with_hf_config(mc.hf_text_config, architectures=["KimiLinearForCausalLM"])
    with set_current_vllm_config(text_vc):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method="file://" + tempfile.mktemp())
        initialize_model_parallel(1, 1)
        from vllm.models.kimi_k3.amd.linear import KimiLinearForCausalLM
        from vllm.models.kimi_k3.amd.model import KimiK3ForConditionalGeneration
        from vllm.models.kimi_k3.amd.mtp import KimiK3MTP

        torch.set_default_dtype(torch.bfloat16)
        text = KimiLinearForCausalLM(vllm_config=text_vc, prefix="language_model")
        mtp = KimiK3MTP(vllm_config=text_vc, prefix="model")
        mapper = KimiK3ForConditionalGeneration.hf_to_vllm_mapper
        names = [k for k, _ in tensors(d)]
        mapped = {}
        for k, t in tensors(d):
            m = mapper._map_name(k)
            if m and m.startswith("language_model."):
                mapped[m[len("language_model."):]] = t
        loaded_text = text.load_weights(iter(mapped.items()))
        loaded_mtp = mtp.load_weights(tensors(d))
    for name, model, loaded in (("text", text, loaded_text), ("mtp", mtp, loaded_mtp)):
        params = {n for n, _ in model.named_parameters()}
        out[name] = {"params": len(params), "loaded": len(loaded & params),
                     "not_loaded": sorted(params - loaded)[:20],
                     "shapes": {n: list(p.shape) for n, p in model.named_parameters()
                                if "experts" in n and "shared" not in n}}
    out["tensors"] = len(names)
    out["unused"] = sorted(set(k for k in names if not k.startswith("language_model.")))
    return out


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1])), flush=True)
