"""Kimi-K3's published dimensions: the one table the settings, the base checks, the slicer, the
synthetic test checkpoint and the docs' sizes follow. Stdlib only, imports nothing.

Kimi-K3 is HF ``KimiK3ForConditionalGeneration`` (``model_type`` kimi_k3) whose text model is
``text_config`` (``model_type`` kimi_linear). Each row of :data:`KIMI_K3` is a ``text_config``
key as vLLM's ``KimiLinearConfig`` reads it (vLLM 0.27.1 wheel,
``vllm/transformers_utils/configs/kimi_linear.py:11-58``), its value, and where the value is
published. Where the published label differs from the key vLLM reads, the source says so.
``tests/data/census/models/kimi-k3/config.json`` (the census test data) and the synthetic
checkpoint of ``tests/kimi_k3_layout.py`` are checked against this table by the tests.
"""

RECIPE = "vLLM recipe models/moonshotai/Kimi-K3.yaml"
CONFIG_REVISION = "9f62e4e9fffbd0a83ddd60e1c209d828994b3569"
CONFIG = f"config.json at revision {CONFIG_REVISION}, as third-party analyzers cite it"
BOTH = f"{RECIPE}; {CONFIG}"

# text_config key -> (value, source)
KIMI_K3: dict[str, tuple[int, str]] = {
    "num_hidden_layers": (93, f"{BOTH} (69 KDA + 24 MLA decoder layers)"),
    "hidden_size": (7168, BOTH),
    "vocab_size": (163840, BOTH),
    "num_attention_heads": (96, f"{BOTH}; also linear_attn_config.num_heads"),
    "q_lora_rank": (1536, BOTH),
    "kv_lora_rank": (512, BOTH),
    "qk_nope_head_dim": (128, BOTH),
    "qk_rope_head_dim": (64, BOTH),
    "v_head_dim": (128, BOTH),
    "num_experts": (896, f"{BOTH} (routed experts)"),
    "num_experts_per_token": (16, BOTH),
    "num_shared_experts": (2, BOTH),
    "moe_intermediate_size": (3072, BOTH),
    "routed_expert_hidden_size": (3584, f"{BOTH} (latent experts: routed experts work at this "
                                        "width between routed_expert_down_proj and _up_proj)"),
    "intermediate_size": (33792, f"{BOTH}, published as dense_intermediate_size (the dense "
                                 "MLP of layers < first_k_dense_replace; vLLM reads "
                                 "intermediate_size)"),
    "first_k_dense_replace": (1, BOTH),
    "attn_res_block_size": (12, f"{BOTH}, published as attention_residual_block_size (vLLM "
                                "reads attn_res_block_size)"),
}

# Decoder layers that are MLA, 1-based as linear_attn_config.full_attn_layers: every 4th, and the
# last (source: BOTH); the others are KDA (linear_attn_config.kda_layers).
_N = KIMI_K3["num_hidden_layers"][0]
KIMI_K3_MLA_LAYERS: tuple[int, ...] = (*range(4, _N, 4), _N)

# Routed experts are MXFP4 in compressed-tensors' "mxfp4-pack-quantized" format, groups of 32
# (source: BOTH): per expert and projection a uint8 ``weight_packed`` [out, in / 2] (two e2m1
# values a byte) and a uint8 E8M0 ``weight_scale`` [out, in / 32].
KIMI_K3_QUANT_FORMAT = "mxfp4-pack-quantized"
KIMI_K3_GROUP_SIZE = 32

# ~1.56 TB of weights (source: BOTH); the index's total_size at the pinned revision
# (k3rocm.deploy.checkpoint.REVISION, from public records) is this many bytes.
KIMI_K3_CHECKPOINT_BYTES = 1_560_860_324_864

KIMI_K3_HEADS = KIMI_K3["num_attention_heads"][0]
