# SPDX-License-Identifier: Apache-2.0
# k3rocm overlay: AMD-local MLA wrapper for Kimi-K3, written for the vLLM 0.27.x API
# (the pinned nightly). Reads section by section like upstream vLLM 0.34's
# vllm/models/kimi_k3/amd/mla.py (same method names where the behaviour is the same);
# the differences are marked "k3rocm:". Like upstream, it imports nothing outside vLLM,
# torch and the standard library, so this one file can be mounted into an image by itself.
"""AMD-specific MLA wrapper for Kimi-K3 (k3rocm overlay)."""

import json
import os
import re
import sys
import tempfile
from typing import Any, cast

import torch
from vllm.logger import init_logger
from vllm.model_executor.layers.attention.attention import get_attention_context
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.mla import MultiHeadLatentAttentionWrapper
from vllm.platforms import current_platform

logger = init_logger(__name__)

K3ROCM_OVERLAY = 1  # marker: this file is the k3rocm overlay, not upstream vLLM code

_OPT_KV_LORA_RANK = 512
_OPT_ROT_DIM = 64
_OPT_MIN_SIZE = 2048
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class KimiK3MultiHeadLatentAttentionWrapper(MultiHeadLatentAttentionWrapper):
    """Kimi-K3 MLA wrapper with the eager AITER q/kv RMSNorm fusion and a fused
    decode Q-prep path.

    Load-time gates are decided once: at construction, and (k3rocm: for the facts the
    0.27 API only has after weight loading) once more at the first forward. Per batch
    only "is this batch decode-only" is checked.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # k3rocm: the toggles (K3_FUSE_*) and the probe (bottom of this file) are read once
        # per process; every decision is written down as a record.
        self._asked = {name: _asked(name) for name in FUSION_ENV}
        self._layer_kind = _layer_kind(self.mla_attn.layer_name)
        self._use_eager_qk_rmsnorm_fusion, self._qk_rmsnorm_why = (
            self._qk_rmsnorm_fusion_supported()
        )
        self._fused_qk_prep, self._fused_qk_prep_why = self._fused_qk_prep_supported()
        self._load_gates_pending = self._fused_qk_prep
        # k3rocm: the backend's padded head count (AITER asm decode runs 16 heads at < 16 heads
        # per rank). q_out is allocated for it and the real heads are a view, so a backend
        # whose padding recognises that view (vLLM 0.33 get_mla_padded_q) copies nothing.
        self._fused_q_heads = self.num_heads
        # Positions fed to the fused kernel's identity RoPE; see _fused_decode. One zeroed
        # buffer per layer, allocated here and sliced per call, so every captured CUDA graph
        # reads the same memory and no graph captures a fill.
        zero_positions = None
        if self._fused_qk_prep:
            try:
                zero_positions = torch.zeros(_max_batch_tokens(), dtype=torch.int64)
                # k3rocm: the identity cos/sin rows too (upstream builds them at the first
                # decode), never allocated inside forward.
                self._identity_cos, self._identity_sin = _identity_rope(
                    self.qk_rope_head_dim // 2, torch.get_default_dtype())
            except Exception as exc:  # noqa: BLE001 - k3rocm: serve stock
                self._fused_qk_prep = self._load_gates_pending = False
                self._fused_qk_prep_why = f"zero positions / identity cos-sin: {exc}"
                zero_positions = None
        self.register_buffer("_zero_positions", zero_positions, persistent=False)
        self._record("construct")

    def _qk_rmsnorm_fusion_supported(self) -> tuple[bool, str]:
        try:
            return self._qk_rmsnorm_gates()
        except Exception as exc:  # noqa: BLE001 - k3rocm: a gate error serves stock
            return False, f"gate error ({type(exc).__name__}: {exc})"

    def _fused_qk_prep_supported(self) -> tuple[bool, str]:
        try:
            return self._fused_qk_prep_gates()
        except Exception as exc:  # noqa: BLE001 - k3rocm: a gate error serves stock
            return False, f"gate error ({type(exc).__name__}: {exc})"

    def _qk_rmsnorm_gates(self) -> tuple[bool, str]:
        if not self._asked["qk_norm"]:
            return False, "K3_FUSE_QK_NORM=0"
        ok, why = _qk_norm_platform_gate(_probe())
        if not ok:
            return False, why
        if self.q_lora_rank is None or self.q_a_layernorm is None:
            return False, "no q_lora_rank (no q_a_layernorm to fuse)"
        if not (_plain_rmsnorm(self.q_a_layernorm) and _plain_rmsnorm(self.kv_a_layernorm)):
            return False, "q_a/kv_a layernorms are not plain weighted RMSNorm"
        return True, why

    def _fused_qk_prep_gates(self) -> tuple[bool, str]:
        attn = self.mla_attn
        if not self._asked["decode_qprep"]:
            return False, "K3_FUSE_DECODE_QPREP=0"
        ok, why = _qprep_platform_gate(_probe())
        if not ok:
            return False, why
        if not str(attn.kv_cache_dtype).startswith("fp8"):
            return False, f"kv cache dtype {attn.kv_cache_dtype} is not fp8"
        if self.kv_lora_rank != _OPT_KV_LORA_RANK:
            return False, f"kv_lora_rank {self.kv_lora_rank} != {_OPT_KV_LORA_RANK}"
        if self.qk_rope_head_dim != _OPT_ROT_DIM:
            return False, f"rope dim {self.qk_rope_head_dim} != {_OPT_ROT_DIM}"
        if self.kv_lora_rank * self.num_heads < _OPT_MIN_SIZE:
            # As upstream: only where AITER picks its _opt / per-head kernels, not the
            # general one it takes below this size.
            return False, (f"kv_lora_rank x heads per rank = {self.kv_lora_rank}x"
                           f"{self.num_heads} < {_OPT_MIN_SIZE}")
        # The fused kernel writes q_out only for slot >= 0, so padded rows would
        # be garbage after a DCP query all-gather. PCP and HiSparse rewrite the
        # KV inputs/slots before the standalone write, which this path bypasses.
        # k3rocm: attributes that older vLLM builds lack are read defensively.
        if getattr(attn.impl, "dcp_world_size", -1) > 1 or self.dcp_q_replicate:
            return False, "decode context parallel is on"
        if getattr(attn, "use_pcp", False):
            return False, "prefill context parallel is on"
        if getattr(attn, "hisparse_cache", None) is not None:
            return False, "HiSparse cache is on"
        if getattr(attn, "q_pad_num_heads", None) is not None:
            return False, f"query head padding to {attn.q_pad_num_heads}"
        if self.indexer is not None or self.is_sparse:
            return False, "sparse MLA / indexer"
        if self.rotary_emb is not None:
            return False, "model applies a real rotary embedding in MLA"
        if getattr(attn, "calculate_kv_scales", False):
            return False, "dynamic kv scales (calculate_kv_scales)"
        # Only the W_UK variants reproduced in _fused_decode are supported
        # (fp4 is checked before fp8, as MLAAttention does).
        if not attn.is_aiter_triton_fp4_bmm_enabled and getattr(
            attn, "is_aiter_triton_fp8_bmm_enabled", False
        ):
            return False, "W_UK variant is the AITER fp8 bmm (not reproduced here)"
        return True, why

    def _fused_qk_prep_supported_after_load(self) -> tuple[bool, str]:
        """k3rocm: facts the 0.27 API only has after weight loading (first forward)."""
        attn = self.mla_attn
        dcp = getattr(attn.impl, "dcp_world_size", -1)
        if dcp < 0:  # not known at construction in this vLLM
            from vllm.distributed.parallel_state import get_dcp_group

            dcp = get_dcp_group().world_size
        if dcp > 1:
            return False, "decode context parallel is on"
        if not attn.is_aiter_triton_fp4_bmm_enabled and getattr(attn, "W_UK_T", None) is None:
            return False, "W_UK_T missing after weight loading (no bf16 W_UK bmm)"
        if not getattr(attn.impl, "supports_quant_query_input", False):
            return False, "attention backend wants a bf16 query (supports_quant_query_input)"
        # k3rocm: the route the backend really takes for this head count and query length
        # (decode-only batches are 1 + speculative tokens long): AITER's Gluon kernel takes
        # a bf16 query only (aiter/ops/triton/gluon/mla_gluon.py), and vLLM 0.27.1 sends every
        # < 16-head decode there (use_gluon_decode(num_heads, max_qo_len) has no dtype).
        helper = _aiter_mla_helper(attn.impl)
        if helper is not None:
            bad = _gluon_route(helper, self.num_heads, str(attn.kv_cache_dtype),
                               1 + _num_spec_tokens())
            if bad:
                return False, bad
            self._fused_q_heads = int(helper.get_actual_mla_num_heads(self.num_heads))
        return True, self._fused_qk_prep_why

    def _record(self, phase: str) -> None:
        _record_decision(self._layer_kind, phase, {
            "qk_norm": {"state": "on" if self._use_eager_qk_rmsnorm_fusion else "off",
                        "reason": self._qk_rmsnorm_why},
            "decode_qprep": {
                "state": ("needs-model" if self._load_gates_pending
                          else "on" if self._fused_qk_prep else "off"),
                "reason": self._fused_qk_prep_why},
        }, self._asked)

    def _check_load_gates(self, dtype: torch.dtype) -> None:
        """``dtype``: the activations' dtype, which kv_c (the kernel reads cos/sin as kv_c's
        dtype, ``scalar_t``) has too."""
        self._load_gates_pending = False
        try:
            self._fused_qk_prep, self._fused_qk_prep_why = (
                self._fused_qk_prep_supported_after_load()
            )
        except Exception as exc:  # noqa: BLE001 - k3rocm: a gate error serves stock
            self._fused_qk_prep = False
            self._fused_qk_prep_why = f"gate error ({type(exc).__name__}: {exc})"
        if self._fused_qk_prep and self._identity_cos.dtype != dtype:
            self._identity_cos, self._identity_sin = _identity_rope(
                self._identity_cos.shape[1], dtype)
        self._record("load")

    def get_input_quant_key(self):
        """k3rocm: vLLM 0.32's amd/linear.py asks the wrapper which quantized activation its
        input projections take (upstream's twin answers from the projections); the 0.27 API
        has no quantized activations, so the overlay takes plain ones: None."""
        return None

    def _normalize_q_kv(
        self,
        q_c: torch.Tensor,
        kv_c: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q_layernorm = cast(RMSNorm, self.q_a_layernorm)
        kv_layernorm = cast(RMSNorm, self.kv_a_layernorm)

        if self._use_eager_qk_rmsnorm_fusion and not torch.compiler.is_compiling():
            return torch.ops.vllm.fused_mla_dual_rms_norm(
                q_c,
                q_layernorm.weight,
                kv_c,
                kv_layernorm.weight,
                q_layernorm.variance_epsilon,
                kv_layernorm.variance_epsilon,
            )

        return q_layernorm(q_c), kv_layernorm(kv_c)

    def _fused_decode(
        self,
        q: torch.Tensor,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        output_shape: tuple[int, int],
        attn_metadata,
        layer,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        """Decode-only MLA through one fused AITER launch.

        Replaces the fp8 KV-cache write plus the ``[ql_nope | q_pe]`` concat and
        that query's static fp8 quant with a single
        ``fused_qk_rope_concat_and_cache_mla``.
        """
        from aiter.ops.cache import fused_qk_rope_concat_and_cache_mla

        attn = self.mla_attn
        # k3rocm: only the rows the metadata covers (CUDA-graph padding is not
        # handed to the decode kernel, as in the stock MQA split).
        n = attn_metadata.num_actual_tokens
        q, kv_c_normed, k_pe = q[:n], kv_c_normed[:n], k_pe[:n]
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        # (B, N, P) -> (N, B, P)
        q_nope_t = q_nope.transpose(0, 1)

        # Mirror MLAAttention.forward_impl's W_UK dispatch, including its
        # precedence (fp4 is checked before fp8): ql_nope must be what the unfused
        # path feeds its concat + quant. Both variants return bf16.
        if attn.is_aiter_triton_fp4_bmm_enabled:
            from aiter.ops.triton.batched_gemm_a16wfp4 import batched_gemm_a16wfp4

            ql_nope = batched_gemm_a16wfp4(
                q_nope_t,
                attn.W_K,
                attn.W_K_scale,
                transpose_bm=True,
                prequant=True,
                y_scale=layer._q_scale,
            )
        else:
            B, N = q_nope.shape[0], q_nope.shape[1]
            L = attn.W_UK_T.shape[-1]
            # The bmm writes through the (N, B, L) view of a dense (B, N, L) buffer,
            # so the `.contiguous()` below is free: no copy kernel per layer and step.
            ql_nope = q_nope_t.new_empty((B, N, L))
            torch.bmm(q_nope_t, attn.W_UK_T, out=ql_nope.transpose(0, 1))

        # An fp8 KV cache is allocated as uint8 and re-viewed as fp8 before use;
        # the AITER kernel rejects the raw uint8 dtype outright.
        fp8_dtype = current_platform.fp8_dtype()
        if kv_cache.dtype != fp8_dtype:
            kv_cache = kv_cache.view(fp8_dtype)

        head_size = attn.kv_lora_rank + self.qk_rope_head_dim
        num_tokens, num_heads = ql_nope.shape[:2]
        q_out = torch.empty(
            (num_tokens, self._fused_q_heads, head_size), dtype=fp8_dtype,
            device=ql_nope.device,
        )[:, :num_heads]
        # cos = 1, sin = 0: the kernel's RoPE is the identity, which is what a NoPE model
        # needs, and then position 0 is exact for every token. The kernel is given zeros, not
        # the real positions: the cos/sin cache has one row (a full-length one would cost
        # ~268 MB at K3's 1M positions), and not every AITER variant clamps a position into
        # it (the general kernel does not; upstream names v0.1.26's head-grouped kernel,
        # which reads cos = sin = 0 past the row, zeroing q_pe and the cached k_pe).
        fused_qk_rope_concat_and_cache_mla(
            ql_nope.contiguous(),
            q_pe,
            kv_c_normed,
            k_pe.squeeze(1),
            kv_cache.view(kv_cache.shape[0], -1, head_size),
            q_out,
            slot_mapping[:n].flatten(),
            layer._k_scale,
            layer._q_scale,
            self._zero_positions[:n],
            self._identity_cos,
            self._identity_sin,
            is_neox=True,
            is_nope_first=True,
        )

        attn_out, _ = attn.impl.forward_mqa(q_out, kv_cache, attn_metadata, attn)
        output = q.new_empty(output_shape)
        attn._v_up_proj(attn_out, out=output[:n])
        return output

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        llama_4_scaling: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self._load_gates_pending:  # k3rocm: once, at the first forward
            self._check_load_gates(hidden_states.dtype)
        q_c = None

        if self.q_lora_rank is not None:
            assert self.fused_qkv_a_proj is not None, (
                "fused_qkv_a_proj is required when q_lora_rank is not None"
            )
            assert self.q_a_layernorm is not None, (
                "q_a_layernorm is required when q_lora_rank is not None"
            )
            assert self.q_b_proj is not None, (
                "q_b_proj is required when q_lora_rank is not None"
            )

            qkv_lora = self.fused_qkv_a_proj(hidden_states)[0]
            q_c, kv_lora = qkv_lora.split(
                [self.q_lora_rank, self.kv_lora_rank + self.qk_rope_head_dim],
                dim=-1,
            )
            kv_c, k_pe = kv_lora.split(
                [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
            )
            q_proj_input, kv_c_normed = self._normalize_q_kv(q_c, kv_c)
            q_proj_layer = self.q_b_proj
        else:
            assert self.kv_a_proj_with_mqa is not None, (
                "kv_a_proj_with_mqa is required when q_lora_rank is None"
            )
            assert self.q_proj is not None, (
                "q_proj is required when q_lora_rank is None"
            )
            kv_lora = self.kv_a_proj_with_mqa(hidden_states)[0]
            kv_c, k_pe = kv_lora.split(
                [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
            )
            kv_c_normed = self.kv_a_layernorm(kv_c)
            q_proj_layer = self.q_proj
            q_proj_input = hidden_states

        # Add head dim of 1 to k_pe.
        k_pe = k_pe.unsqueeze(1)

        q = q_proj_layer(q_proj_input)[0]
        heads = self.num_heads
        if self.dcp_q_replicate:
            heads *= q_proj_layer.group_size
        q = q.view(-1, heads, self.qk_head_dim)

        if self.rotary_emb is not None:
            q[..., self.qk_nope_head_dim :], k_pe = self.rotary_emb(
                positions, q[..., self.qk_nope_head_dim :], k_pe
            )

        if self.indexer and self.is_sparse and not self.skip_topk:
            self.indexer(hidden_states, q_c, positions, self.indexer_rope_emb)

        if llama_4_scaling is not None:
            q *= llama_4_scaling

        q_dcp_replicated = None
        if self.dcp_q_replicate:
            q_dcp_replicated, q = q, q_proj_layer._local_view(q)

        output_shape = (hidden_states.shape[0], self.num_heads * self.v_head_dim)

        # The fused decode path covers only the MQA slice, so it is taken for
        # decode-only batches (the backend's split: every token a decode token);
        # anything else falls through to MLAAttention.
        attn_metadata = layer = kv_cache = slot_mapping = None
        fuse = self._fused_qk_prep and q_dcp_replicated is None
        if fuse:
            attn_metadata, layer, kv_cache, slot_mapping = get_attention_context(
                self.mla_attn.layer_name
            )
            fuse = (
                attn_metadata is not None
                and slot_mapping is not None
                and kv_cache.numel() > 0
                and attn_metadata.num_actual_tokens > 0
                and attn_metadata.num_actual_tokens == attn_metadata.num_decode_tokens
                # k3rocm: never longer than the zero positions (max_num_batched_tokens)
                and attn_metadata.num_actual_tokens <= self._zero_positions.shape[0]
            )

        if fuse:
            attn_out = self._fused_decode(
                q,
                kv_c_normed,
                k_pe,
                output_shape,
                attn_metadata,
                layer,
                kv_cache,
                slot_mapping,
            )
        else:
            attn_out = self.mla_attn(
                q,
                kv_c_normed,
                k_pe,
                output_shape=output_shape,
                q_dcp_replicated=q_dcp_replicated,
            )

        if self.g_proj is not None:
            attn_out = attn_out * self.g_proj(hidden_states)[0].sigmoid()

        return self.o_proj(attn_out)[0]


_IDENTITY: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _identity_rope(half: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """k3rocm: the one-row identity cos/sin (cos = 1, sin = 0) per width, dtype and device,
    shared by every layer."""
    key = (half, dtype, str(torch.empty(0).device))
    if key not in _IDENTITY:
        _IDENTITY[key] = (torch.ones(1, half, dtype=dtype), torch.zeros(1, half, dtype=dtype))
    return _IDENTITY[key]


def _vllm_config():
    try:
        from vllm.config import get_current_vllm_config

        return get_current_vllm_config()
    except Exception:  # noqa: BLE001 - no config (unit construction)
        return None


def _max_batch_tokens() -> int:
    """The most tokens one forward can carry: the scheduler's token budget, or the largest
    CUDA graph capture size when that is larger (graphs are captured at their sizes)."""
    cfg = _vllm_config()
    sched = getattr(cfg, "scheduler_config", None)
    if sched is None or not getattr(sched, "max_num_batched_tokens", None):
        raise RuntimeError("max_num_batched_tokens unknown (no scheduler config)")
    comp = getattr(cfg, "compilation_config", None)
    return max(int(sched.max_num_batched_tokens),
               int(getattr(comp, "max_cudagraph_capture_size", 0) or 0))


def _num_spec_tokens() -> int:
    spec = getattr(_vllm_config(), "speculative_config", None)
    return int(getattr(spec, "num_speculative_tokens", 0) or 0)


def _aiter_mla_helper(impl):
    """k3rocm: vLLM's ``AiterMLAHelper`` beside the backend's impl class, if it has one."""
    return getattr(sys.modules.get(type(impl).__module__), "AiterMLAHelper", None)


def _gluon_route(helper, heads: int, kv_dtype: str, verify_qlen: int) -> str | None:
    """k3rocm: why the backend's decode route wants a bf16 query, or None. Asks the helper
    with the signature it has (vLLM 0.27.1: use_gluon_decode(num_heads, max_qo_len); 0.32+:
    also kv_cache_dtype, and use_gluon_verify for multi-token verify)."""
    import inspect

    def ask(fn, qlen):
        kw = {"kv_cache_dtype": kv_dtype} if "kv_cache_dtype" in inspect.signature(
            fn).parameters else {}
        return bool(fn(heads, qlen, **kw))

    if ask(helper.use_gluon_decode, 1):
        return f"decode at {heads} heads/rank goes to AITER's Gluon kernel (bf16 query only)"
    if verify_qlen > 1:
        verify = getattr(helper, "use_gluon_verify", None)
        if verify is not None:
            if ask(verify, verify_qlen):
                return (f"verify (query length {verify_qlen}) at {heads} heads/rank goes to "
                        "AITER's Gluon kernel (bf16 query only)")
        elif ask(helper.use_gluon_decode, verify_qlen) or heads < 16:
            return (f"verify (query length {verify_qlen}) at {heads} heads/rank is flattened "
                    "onto AITER's Gluon kernel (bf16 query only)")
    return None


def _layer_kind(layer_name: str) -> str:
    """k3rocm: "draft" for MTP layers (numbered after the target's decoder layers)."""
    if "mtp" in layer_name:
        return "draft"
    m = _LAYER_INDEX.search(layer_name)
    if m is None:
        return "target"
    mc = getattr(_vllm_config(), "model_config", None)
    layers = getattr(getattr(mc, "hf_text_config", None), "num_hidden_layers", None)
    if layers is None:  # no model config (unit construction)
        return "target"
    return "draft" if int(m.group(1)) >= int(layers) else "target"


def _plain_rmsnorm(module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        isinstance(weight, torch.Tensor)
        and hasattr(module, "variance_epsilon")
        and getattr(module, "variance_size_override", None) is None
        and getattr(module, "has_weight", True)
    )


# ----------------------------------------------------------------------------------------
# k3rocm: the toggles, the probe and the decision records. Read by k3rocm (the probe CLI
# runs probe_report() of this file; its decision reader parses the records), never the
# other way round.
#
# The probe asks the real sources, never a test switch:
# - the decode Q-prep kernel: ``import aiter.ops.cache`` registers the op as
#   ``torch.ops.aiter.fused_qk_rope_concat_and_cache_mla`` (ROCm/aiter ``aiter/jit/core.py``
#   ``compile_ops`` -> ``aiter/jit/utils/torch_guard.py`` ``torch_compile_guard``). The
#   function AITER exports is a bare ``wrapper_custom(*args, **kwargs)``, so its
#   ``inspect.signature`` says nothing; the registered *schema* does, and the probe reports
#   it (``compute_all_q_rope`` came with ROCm/aiter PR #4342). Nothing is decided from it:
#   the fused path gives the kernel all-zero positions, which every AITER variant reads
#   inside its one-row cos/sin cache, clamp or not.
# - the fused q/kv RMSNorm op ``vllm::fused_mla_dual_rms_norm``, registered by
#   ``vllm/_aiter_ops.py`` on ROCm with AITER.
# - the platform: ``current_platform.is_rocm()``, ``rocm_aiter_ops.is_enabled()`` and
#   ``is_mla_enabled()`` (these return None, not False, off ROCm).
#
# Decision records (one JSON object per decision, per process and layer kind) go to the log
# as ``K3ROCM-DECISION {json}`` and, when K3_PROFILER_DIR is set, to
# ``<K3_PROFILER_DIR>/k3rocm-decisions-pid<PID>.json`` beside the profiler traces.

DECISION_MARKER = "K3ROCM-DECISION "
DECISION_SCHEMA = "k3rocm.overlay.decision/1"
DECISION_FILE = "k3rocm-decisions-pid{pid}.json"
FUSION_ENV = {"qk_norm": "K3_FUSE_QK_NORM", "decode_qprep": "K3_FUSE_DECODE_QPREP"}
_QPREP_OP = "fused_qk_rope_concat_and_cache_mla"
_QPREP_NEWER_ARG = "compute_all_q_rope"
_DUAL_NORM_OP = "fused_mla_dual_rms_norm"


class _SwitchError(ValueError):
    """k3rocm: a K3_FUSE_* value that is not a switch."""


def _asked(name: str) -> bool:
    """k3rocm: the K3_FUSE_* toggle for one fusion (1/0, default 1)."""
    env = FUSION_ENV[name]
    raw = os.environ.get(env, "").strip().lower()
    if raw in ("", "1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise _SwitchError(f"{env}={os.environ[env]!r} is not a switch; use 1 or 0")


def _probe_qprep_kernel() -> dict[str, Any]:
    """k3rocm: is AITER's fused Q-prep op registered (and with which schema)?"""
    try:
        import aiter.ops.cache  # noqa: F401 - importing registers torch.ops.aiter.*
    except Exception as exc:  # noqa: BLE001 - no AITER, or one that needs a GPU
        return {"found": False,
                "source": f"aiter.ops.cache not importable ({type(exc).__name__}: {exc})"}
    try:
        schema = getattr(torch.ops.aiter, _QPREP_OP).default._schema
    except (AttributeError, RuntimeError):
        return {"found": False,
                "source": f"torch.ops.aiter.{_QPREP_OP} not registered by aiter.ops.cache"}
    has = _QPREP_NEWER_ARG in [a.name for a in schema.arguments]
    return {"found": True,
            "source": f"torch.ops.aiter.{_QPREP_OP} schema "
                      f"({'has' if has else 'no'} {_QPREP_NEWER_ARG})",
            "schema": str(schema)}


def _probe_dual_norm_op() -> dict[str, Any]:
    try:
        import vllm._aiter_ops  # noqa: F401 - registers vllm::* AITER ops on ROCm
    except Exception as exc:  # noqa: BLE001
        return {"found": False, "source": f"vllm._aiter_ops not importable ({exc})"}
    found = hasattr(torch.ops.vllm, _DUAL_NORM_OP)
    return {"found": found,
            "source": f"torch.ops.vllm.{_DUAL_NORM_OP} "
                      f"{'registered' if found else 'not registered'} (vllm/_aiter_ops.py)"}


def _platform_facts() -> dict[str, bool]:
    out = {"is_rocm": False, "aiter_enabled": False, "aiter_mla_enabled": False}
    try:
        from vllm._aiter_ops import rocm_aiter_ops

        out["is_rocm"] = bool(current_platform.is_rocm())
        out["aiter_enabled"] = bool(rocm_aiter_ops.is_enabled())  # None off ROCm
        out["aiter_mla_enabled"] = bool(rocm_aiter_ops.is_mla_enabled())
    except Exception:  # noqa: BLE001 - a vLLM without them: nothing is enabled
        pass
    return out


_PROBE: dict[str, Any] | None = None


def _probe(refresh: bool = False) -> dict[str, Any]:
    """k3rocm: everything the wrapper needs to know about this process, gathered once."""
    global _PROBE
    if _PROBE is None or refresh:
        _PROBE = {"platform": _platform_facts(), "qprep_kernel": _probe_qprep_kernel(),
                  "dual_norm_op": _probe_dual_norm_op()}
    return _PROBE


def _qk_norm_platform_gate(p: dict[str, Any]) -> tuple[bool, str]:
    if not p["platform"]["aiter_enabled"]:
        return False, "AITER not enabled (needs ROCm and VLLM_ROCM_USE_AITER=1)"
    if not p["dual_norm_op"]["found"]:
        return False, f"torch.ops.vllm.{_DUAL_NORM_OP} not registered"
    return True, f"{_DUAL_NORM_OP} (one AITER launch)"


def _qprep_platform_gate(p: dict[str, Any]) -> tuple[bool, str]:
    if not p["platform"]["is_rocm"]:
        return False, "platform is not ROCm"
    if not p["platform"]["aiter_mla_enabled"]:
        return False, "AITER MLA not enabled"
    if not p["qprep_kernel"]["found"]:
        return False, f"aiter {_QPREP_OP} not found ({p['qprep_kernel']['source']})"
    return True, f"{_QPREP_OP} (identity rope: 1-row cos/sin, all-zero positions)"


def probe_report() -> dict[str, Any]:
    """k3rocm: ``k3rocm overlay probe --json``: the probe plus what it means for each fusion.

    Gates that need the loaded model (kv cache dtype, heads per rank, W_UK variant, the
    backend's fp8-query support, DCP) are not decided here: state ``needs-model``."""
    p = _probe(refresh=True)
    fusions: dict[str, dict[str, str]] = {}
    for name, gate in (("qk_norm", _qk_norm_platform_gate),
                       ("decode_qprep", _qprep_platform_gate)):
        try:
            want = _asked(name)
        except _SwitchError as exc:
            fusions[name] = {"state": "off", "reason": str(exc)}
            continue
        ok, why = gate(p)
        if not want:
            fusions[name] = {"state": "off", "reason": f"{FUSION_ENV[name]}=0"}
        elif not ok:
            fusions[name] = {"state": "off", "reason": why}
        else:
            fusions[name] = {"state": "needs-model",
                             "reason": f"platform gates pass: {why}; the rest is decided per "
                                       "layer when the model is built and its weights loaded"}
    return {"platform": p["platform"], "qprep_kernel": p["qprep_kernel"],
            "dual_norm_op": p["dual_norm_op"], "fusions": fusions,
            "python": sys.version.split()[0]}


_RECORDS: list[dict[str, Any]] = []
_SEEN: set[str] = set()


def _tp_rank() -> int | None:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - not initialized (unit construction)
        return None


def _vllm_version() -> str:
    try:
        import vllm

        return str(vllm.__version__)
    except Exception:  # noqa: BLE001
        return "unknown"


def _process_name() -> str:
    try:
        import multiprocessing

        return multiprocessing.current_process().name
    except Exception:  # noqa: BLE001
        return "main"


def _record_decision(layer_kind: str, phase: str, fusions: dict[str, dict[str, str]],
                     asked: dict[str, bool]) -> dict[str, Any] | None:
    """k3rocm: write one decision record (once per distinct decision of a process and
    layer kind)."""
    key = json.dumps([layer_kind, phase, fusions], sort_keys=True)
    if key in _SEEN:
        return None
    _SEEN.add(key)
    p = _probe()
    rec = {"schema": DECISION_SCHEMA, "pid": os.getpid(),
           "process": _process_name(), "tp_rank": _tp_rank(), "layer_kind": layer_kind,
           "phase": phase, "vllm_version": _vllm_version(), "fusions": fusions,
           "asked": asked,
           "probe": {"qprep_kernel": {k: p["qprep_kernel"][k] for k in ("found", "source")},
                     "dual_norm_op": p["dual_norm_op"]}}
    _RECORDS.append(rec)
    logger.info(DECISION_MARKER + json.dumps(rec, sort_keys=True))
    _write_beside_traces()
    return rec


def _write_beside_traces() -> None:
    out = os.environ.get("K3_PROFILER_DIR", "").strip()
    if not out:
        return
    try:
        os.makedirs(out, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out, prefix=".k3rocm-decisions-")
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(_RECORDS, fh, indent=1, sort_keys=True)
        os.chmod(tmp, 0o644)
        os.replace(tmp, os.path.join(out, DECISION_FILE.format(pid=os.getpid())))
    except OSError as exc:  # the log line above still carries the record
        logger.warning("k3rocm overlay: cannot write decisions into %s (%s)", out, exc)
