"""The layer counts the census judges by, from a model's config.json (a Kimi-K3 checkpoint's
against its published layout, :mod:`k3rocm.serving.modelfacts`)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from k3rocm.errors import UsageError
from k3rocm.serving.modelfacts import KIMI_K3, KIMI_K3_MLA_LAYERS


@dataclass
class ModelFacts:
    path: str
    model_type: str  # of the text model (kimi_linear for Kimi-K3)
    layers: int
    mla_layers: int


def read_model_facts(model: str | os.PathLike) -> ModelFacts:
    p = Path(model)
    cfg_path = p / "config.json" if p.is_dir() else p
    if not cfg_path.is_file():
        raise UsageError(f"model config {cfg_path} not found; pass --model-dir with the "
                         "checkpoint directory (holding config.json) as seen from this host")
    try:
        top = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"model config {cfg_path} is not valid JSON ({exc})") from None
    text = top.get("text_config") if isinstance(top.get("text_config"), dict) else top
    top_type = str(top.get("model_type", ""))
    mtype = str(text.get("model_type", "") or ("kimi_linear" if top_type == "kimi_k3" else ""))
    n = text.get("num_hidden_layers")
    if not isinstance(n, int) or n <= 0:
        raise UsageError(f"model config {cfg_path} has no positive num_hidden_layers "
                         f"(got {n!r})")
    if text.get("mla_use_nope") is not True and all(
            text.get(k) is None for k in ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim")):
        raise UsageError(f"model {cfg_path} (model_type {mtype or top_type!r}) has no MLA "
                         "attention (no kv_lora_rank); the census counts MLA kernels")
    lac = text.get("linear_attn_config")
    kda = lac.get("kda_layers") if isinstance(lac, dict) else None  # 1-based, as vLLM reads it
    kda_set = {int(i) for i in kda or []}
    mla = [i for i in range(n) if (i + 1) not in kda_set]
    full = lac.get("full_attn_layers") if kda is not None else None
    if full is not None and sorted(int(i) - 1 for i in full) != mla:
        raise UsageError(
            f"model config {cfg_path}: linear_attn_config.full_attn_layers ({len(full)} layers) "
            f"disagrees with the layers not in kda_layers ({len(mla)}); cannot tell which "
            "layers are MLA")
    published = [i - 1 for i in KIMI_K3_MLA_LAYERS], KIMI_K3["num_hidden_layers"][0]
    if top_type == "kimi_k3" and "k3rocm_slice" not in top and (mla, n) != published:
        raise UsageError(  # the full checkpoint
            f"model config {cfg_path}: {len(mla)} MLA layers of {n}, but Kimi-K3's published "
            f"config has {len(published[0])} of {published[1]} (k3rocm.serving.modelfacts); a "
            "different model or revision: the census would count launches per layer against "
            "the wrong layer count")
    return ModelFacts(str(cfg_path), mtype or top_type, n, len(mla))
