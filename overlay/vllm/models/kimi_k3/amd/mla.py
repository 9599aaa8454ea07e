# SPDX-License-Identifier: Apache-2.0
# k3rocm overlay: AMD-local MLA wrapper for Kimi-K3 (written for the vLLM 0.27.x API).
"""Kimi-K3 MLA wrapper for ROCm with two AITER fusions.

1. q/kv RMSNorm fusion: ``q_a_layernorm`` and ``kv_a_layernorm`` become one
   ``torch.ops.vllm.fused_mla_dual_rms_norm`` launch (eager mode only; Kimi-K3 is
   not torch.compiled, so the compiler pass that fuses this elsewhere never runs).
2. Decode Q-prep fusion: on decode-only batches the fp8 KV-cache write and the
   ``[ql_nope | q_pe]`` concat + static fp8 quant become one AITER
   ``fused_qk_rope_concat_and_cache_mla`` launch, fed an identity rotation from a
   one-row cos/sin cache (the kernel clamps positions into ``[0, rows)``).

Everything fixed at load time is decided once (construction, then the first
forward for facts that only exist after weight loading); per batch only "is this
batch decode-only" is checked. Any other case runs the stock ``MLAAttention`` path.

Toggles (read once, at construction): ``K3_FUSE_QK_NORM`` and
``K3_FUSE_DECODE_QPREP`` (1/0, default 1).

``K3_TEST_REFERENCE_OPS=1`` is for CPU tests only: it takes both kernels from
``k3rocm.testing.reference_ops`` (torch reference implementations) and treats the
ROCm/AITER platform requirement as met. It is logged loudly and never set in the
serving image.
"""

from __future__ import annotations

import inspect
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.model_executor.layers.mla import MultiHeadLatentAttentionWrapper

logger = logging.getLogger("vllm.models.kimi_k3.amd.mla")

K3ROCM_OVERLAY = 1  # marker: this file is the k3rocm overlay, not upstream vLLM code

# AITER's `_opt` decode kernel (the one that clamps positions) needs these.
OPT_KV_LORA_RANK = 512
OPT_ROPE_DIM = 64
OPT_MIN_RANK_X_HEADS = 2048
FP8_KV_DTYPES = ("fp8", "fp8_e4m3")

TEST_ENV = "K3_TEST_REFERENCE_OPS"


def _env_flag(name: str, default: bool = True) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={raw!r} is not a switch; use 1 or 0")


def test_mode() -> bool:
    return os.environ.get(TEST_ENV, "") == "1"


# ----------------------------------------------------------------------------------
# Capability probe: facts about this process, gathered once.
# ----------------------------------------------------------------------------------


@dataclass
class Capabilities:
    is_rocm: bool = False
    aiter_enabled: bool = False
    aiter_mla_enabled: bool = False
    dual_norm_op: bool = False
    dual_norm_source: str = "missing"
    qprep_kernel: Any = None
    qprep_source: str = "missing"
    qprep_clamps: bool = False
    notes: list[str] = field(default_factory=list)


_CAPS: Capabilities | None = None


def _truthy(fn_name: str) -> bool:
    """rocm_aiter_ops.is_*() return None (not False) off ROCm: normalize to bool."""
    try:
        from vllm._aiter_ops import rocm_aiter_ops

        return bool(getattr(rocm_aiter_ops, fn_name)())
    except Exception:  # noqa: BLE001 - any failure means "not available"
        return False


def dual_norm_op_registered() -> bool:
    try:
        return hasattr(torch.ops.vllm, "fused_mla_dual_rms_norm")
    except Exception:  # noqa: BLE001
        return False


def _register_dual_norm_op_from_aiter() -> bool:
    """Older vLLM builds (the pinned nightly, 0.27.x) do not register
    ``vllm::fused_mla_dual_rms_norm``; register it here over AITER's
    ``_fused_qk_rmsnorm`` when AITER ships it."""
    try:
        from aiter.ops.fused_qk_norm_rope_cache_quant import _fused_qk_rmsnorm
        from vllm.utils.torch_utils import direct_register_custom_op
    except Exception:  # noqa: BLE001
        return False

    def _impl(x1, x1_weight, x2, x2_weight, x1_epsilon: float, x2_epsilon: float):
        return _fused_qk_rmsnorm(
            q_out=None, q=x1, q_weight=x1_weight, q_eps=x1_epsilon,
            k_out=None, k=x2, k_weight=x2_weight, k_eps=x2_epsilon,
        )

    def _fake(x1, x1_weight, x2, x2_weight, x1_epsilon: float, x2_epsilon: float):
        return torch.empty_like(x1), torch.empty_like(x2)

    sig = (
        "(Tensor x1, Tensor x1_weight, Tensor x2, Tensor x2_weight, "
        "float x1_epsilon, float x2_epsilon) -> (Tensor, Tensor)"
    )
    _impl.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=a)
         for n, a in (("x1", torch.Tensor), ("x1_weight", torch.Tensor),
                      ("x2", torch.Tensor), ("x2_weight", torch.Tensor),
                      ("x1_epsilon", float), ("x2_epsilon", float))],
        return_annotation=tuple[torch.Tensor, torch.Tensor],
    )
    try:
        direct_register_custom_op(
            op_name="fused_mla_dual_rms_norm", op_func=_impl, mutates_args=[],
            fake_impl=_fake,
        )
    except Exception:  # noqa: BLE001 - fall back to an explicit schema
        try:
            lib = torch.library.Library("vllm", "FRAGMENT")  # noqa: TOR901
            lib.define("fused_mla_dual_rms_norm" + sig)
            lib.impl("fused_mla_dual_rms_norm", _impl, "CUDA")
        except Exception:  # noqa: BLE001
            return False
    return dual_norm_op_registered()


def _find_qprep_kernel() -> tuple[Any, str, bool]:
    """Return (callable, source, clamps_positions)."""
    try:
        from aiter.ops.cache import fused_qk_rope_concat_and_cache_mla as fn
    except Exception:  # noqa: BLE001
        return None, "missing", False
    # The position clamp arrived together with `compute_all_q_rope` (ROCm/aiter
    # #4342); an older kernel reads out of bounds with a one-row cos/sin cache.
    try:
        params = inspect.signature(fn).parameters
        clamps = "compute_all_q_rope" in params
    except (TypeError, ValueError):
        clamps = False
    return fn, "aiter.ops.cache", clamps


def probe_capabilities(refresh: bool = False) -> Capabilities:
    """Gather process-wide facts once (or again with refresh=True)."""
    global _CAPS
    if _CAPS is not None and not refresh:
        return _CAPS
    caps = Capabilities()
    try:
        from vllm.platforms import current_platform

        caps.is_rocm = bool(current_platform.is_rocm())
    except Exception:  # noqa: BLE001
        caps.is_rocm = False
    caps.aiter_enabled = _truthy("is_enabled")
    caps.aiter_mla_enabled = _truthy("is_mla_enabled")

    if test_mode():
        from k3rocm.testing import reference_ops

        reference_ops.register_dual_rms_norm_op()
        caps.is_rocm = caps.aiter_enabled = caps.aiter_mla_enabled = True
        caps.dual_norm_op, caps.dual_norm_source = True, "reference (TEST)"
        caps.qprep_kernel = reference_ops.fused_qk_rope_concat_and_cache_mla
        caps.qprep_source, caps.qprep_clamps = "reference (TEST)", True
        caps.notes.append(f"{TEST_ENV}=1: torch reference kernels, not for serving")
    else:
        if dual_norm_op_registered():
            caps.dual_norm_op, caps.dual_norm_source = True, "vllm"
        elif caps.aiter_enabled and _register_dual_norm_op_from_aiter():
            caps.dual_norm_op, caps.dual_norm_source = True, "overlay over aiter"
        caps.qprep_kernel, caps.qprep_source, caps.qprep_clamps = _find_qprep_kernel()
    _CAPS = caps
    return caps


# ----------------------------------------------------------------------------------
# Gates: pure functions over facts, so each gate can be tested on its own.
# ----------------------------------------------------------------------------------


@dataclass
class NormFacts:
    toggle: bool
    aiter_enabled: bool
    op_registered: bool
    has_q_lora: bool
    plain_rmsnorms: bool


def decide_qk_norm(f: NormFacts) -> tuple[bool, str]:
    if not f.toggle:
        return False, "K3_FUSE_QK_NORM=0"
    if not f.aiter_enabled:
        return False, "AITER not enabled (needs ROCm and VLLM_ROCM_USE_AITER=1)"
    if not f.op_registered:
        return False, "torch.ops.vllm.fused_mla_dual_rms_norm not registered"
    if not f.has_q_lora:
        return False, "no q_lora_rank (no q_a_layernorm to fuse)"
    if not f.plain_rmsnorms:
        return False, "q_a/kv_a layernorms are not plain weighted RMSNorm"
    return True, "fused_mla_dual_rms_norm"


@dataclass
class QPrepFacts:
    toggle: bool = True
    is_rocm: bool = True
    aiter_mla_enabled: bool = True
    kernel_present: bool = True
    kernel_clamps: bool = True
    kv_cache_dtype: str = "fp8"
    kv_lora_rank: int = 512
    rope_dim: int = 64
    heads: int = 12
    dcp_world_size: int = 1  # -1 = unknown yet (resolved at first forward)
    dcp_q_replicate: bool = False
    use_pcp: bool = False
    hisparse: bool = False
    q_pad_num_heads: int | None = None
    fp4_bmm: bool = False
    fp8_bmm: bool = False
    has_w_uk_t: bool | None = True  # None = unknown yet (exists after weight load)
    supports_fp8_query: bool | None = True  # None = unknown yet
    has_rotary: bool = False
    calculate_kv_scales: bool = False
    sparse_or_indexer: bool = False


def decide_decode_qprep(f: QPrepFacts) -> tuple[bool, str]:
    """Every gate a real failure mode; the first failing one is the reason."""
    if not f.toggle:
        return False, "K3_FUSE_DECODE_QPREP=0"
    if not f.is_rocm:
        return False, "platform is not ROCm"
    if not f.aiter_mla_enabled:
        return False, "AITER MLA not enabled"
    if not f.kernel_present:
        return False, "aiter fused_qk_rope_concat_and_cache_mla not found"
    if not f.kernel_clamps:
        return False, ("aiter fused_qk_rope_concat_and_cache_mla predates the position "
                       "clamp (no compute_all_q_rope parameter)")
    if f.kv_cache_dtype not in FP8_KV_DTYPES:
        return False, f"kv cache dtype {f.kv_cache_dtype} is not fp8"
    if f.kv_lora_rank != OPT_KV_LORA_RANK:
        return False, f"kv_lora_rank {f.kv_lora_rank} != {OPT_KV_LORA_RANK}"
    if f.rope_dim != OPT_ROPE_DIM:
        return False, f"rope dim {f.rope_dim} != {OPT_ROPE_DIM}"
    if f.kv_lora_rank * f.heads < OPT_MIN_RANK_X_HEADS:
        return False, (f"kv_lora_rank x heads per rank = {f.kv_lora_rank}x{f.heads} < "
                       f"{OPT_MIN_RANK_X_HEADS} (AITER's general kernel does not clamp)")
    if f.dcp_world_size > 1 or f.dcp_q_replicate:
        return False, "decode context parallel is on"
    if f.use_pcp:
        return False, "prefill context parallel is on"
    if f.hisparse:
        return False, "HiSparse cache is on"
    if f.q_pad_num_heads is not None:
        return False, f"query head padding to {f.q_pad_num_heads}"
    if f.sparse_or_indexer:
        return False, "sparse MLA / indexer"
    if f.has_rotary:
        return False, "model applies a real rotary embedding in MLA"
    if f.calculate_kv_scales:
        return False, "dynamic kv scales (calculate_kv_scales)"
    if f.fp4_bmm:
        pass  # fp4 bmm is checked before fp8 bmm, as MLAAttention does
    elif f.fp8_bmm:
        return False, "W_UK variant is the AITER fp8 bmm (not reproduced by the fused path)"
    elif f.has_w_uk_t is False:
        return False, "W_UK_T missing (no bf16 W_UK bmm)"
    if f.supports_fp8_query is False:
        return False, "attention backend wants a bf16 query (supports_quant_query_input False)"
    if f.dcp_world_size < 0 or f.has_w_uk_t is None or f.supports_fp8_query is None:
        return True, "pending first forward"
    return True, "fused_qk_rope_concat_and_cache_mla (identity rope, 1-row cos/sin)"


# ----------------------------------------------------------------------------------
# The wrapper.
# ----------------------------------------------------------------------------------

_LOGGED: set[str] = set()


def _log_once(key: str, msg: str, *args: Any) -> None:
    if key in _LOGGED:
        return
    _LOGGED.add(key)
    try:  # vLLM's logger config prints "vllm.*" loggers; fall back to logging
        from vllm.logger import init_logger

        init_logger("vllm.k3rocm").info(msg, *args)
    except Exception:  # noqa: BLE001
        logger.info(msg, *args)


class KimiK3MultiHeadLatentAttentionWrapper(MultiHeadLatentAttentionWrapper):
    """MultiHeadLatentAttentionWrapper with the two Kimi-K3 AMD fusions."""

    # Class-level counters (per process) so tests can prove which branch ran.
    counters: dict[str, int] = {
        "qk_norm_fused": 0,
        "qk_norm_stock": 0,
        "decode_qprep_fused": 0,
        "attn_stock": 0,
        "delegated": 0,
    }

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        caps = probe_capabilities()
        self._k3_caps = caps
        attn = self.mla_attn
        base_fused_norm = bool(getattr(self, "fuse_qkv_rmsnorm", False))
        self._k3_delegate = (
            self.indexer is not None or bool(self.is_sparse) or base_fused_norm
        )

        norm_ok, norm_why = decide_qk_norm(NormFacts(
            toggle=_env_flag("K3_FUSE_QK_NORM"),
            aiter_enabled=caps.aiter_enabled,
            op_registered=caps.dual_norm_op,
            has_q_lora=self.q_lora_rank is not None and self.q_a_layernorm is not None,
            plain_rmsnorms=_plain_rmsnorm(self.q_a_layernorm)
            and _plain_rmsnorm(self.kv_a_layernorm),
        ))
        if self._k3_delegate:
            norm_ok, norm_why = False, "stock forward handles sparse/indexer/base-fused layers"
        self._k3_fuse_norm = norm_ok

        impl = attn.impl
        self._k3_qprep_facts = QPrepFacts(
            toggle=_env_flag("K3_FUSE_DECODE_QPREP"),
            is_rocm=caps.is_rocm,
            aiter_mla_enabled=caps.aiter_mla_enabled,
            kernel_present=caps.qprep_kernel is not None,
            kernel_clamps=caps.qprep_clamps,
            kv_cache_dtype=str(getattr(attn, "kv_cache_dtype", "auto")),
            kv_lora_rank=self.kv_lora_rank,
            rope_dim=self.qk_rope_head_dim,
            heads=self.num_heads,
            dcp_world_size=int(getattr(impl, "dcp_world_size", -1)),
            dcp_q_replicate=bool(getattr(self, "dcp_q_replicate", False)),
            use_pcp=bool(getattr(attn, "use_pcp", False)),
            hisparse=getattr(attn, "hisparse_cache", None) is not None,
            q_pad_num_heads=getattr(attn, "q_pad_num_heads", None),
            fp4_bmm=bool(getattr(attn, "is_aiter_triton_fp4_bmm_enabled", False)),
            fp8_bmm=bool(getattr(attn, "is_aiter_triton_fp8_bmm_enabled", False)),
            has_w_uk_t=None,
            supports_fp8_query=None,
            has_rotary=self.rotary_emb is not None,
            calculate_kv_scales=bool(getattr(attn, "calculate_kv_scales", False)),
            sparse_or_indexer=self._k3_delegate,
        )
        self._k3_qprep, self._k3_qprep_why = decide_decode_qprep(self._k3_qprep_facts)
        self._k3_finalized = not self._k3_qprep
        self._k3_identity_rope: tuple[torch.Tensor, torch.Tensor] | None = None

        _log_once("norm", "k3rocm overlay: q/kv RMSNorm fusion %s (%s; op source: %s)",
                  "ON" if norm_ok else "OFF", norm_why, caps.dual_norm_source)
        _log_once("qprep", "k3rocm overlay: decode Q-prep fusion %s (%s; kernel: %s, "
                  "clamps positions: %s, kv dtype %s, heads/rank %d)",
                  "ON" if self._k3_qprep else "OFF", self._k3_qprep_why, caps.qprep_source,
                  caps.qprep_clamps, self._k3_qprep_facts.kv_cache_dtype, self.num_heads)
        for note in caps.notes:
            _log_once("note:" + note, "k3rocm overlay: WARNING %s", note)

    # -- load-time facts that only exist after weight loading ------------------------

    def _k3_finalize(self) -> None:
        """First forward: read the facts that do not exist at construction."""
        self._k3_finalized = True
        attn = self.mla_attn
        impl = attn.impl
        f = self._k3_qprep_facts
        dcp = int(getattr(impl, "dcp_world_size", -1))
        if dcp < 0:
            try:
                from vllm.distributed.parallel_state import get_dcp_group

                dcp = get_dcp_group().world_size
            except Exception:  # noqa: BLE001
                dcp = 1
        f.dcp_world_size = dcp
        f.has_w_uk_t = getattr(attn, "W_UK_T", None) is not None
        f.supports_fp8_query = bool(getattr(impl, "supports_quant_query_input", False))
        ok, why = decide_decode_qprep(f)
        if not ok:
            _log_once("qprep-final", "k3rocm overlay: decode Q-prep fusion OFF after load (%s)",
                      why)
        self._k3_qprep, self._k3_qprep_why = ok, why

    def k3_status(self) -> dict[str, Any]:
        return {
            "qk_norm": self._k3_fuse_norm,
            "decode_qprep": self._k3_qprep,
            "decode_qprep_reason": self._k3_qprep_why,
            "finalized": self._k3_finalized,
        }

    def get_input_quant_key(self) -> Any:
        """Newer upstream ``amd/linear.py`` asks its wrapper for an input quant key (only
        reached with ``--mode force`` over upstream code); None = no input-quant fusion."""
        parent = getattr(super(), "get_input_quant_key", None)
        return parent() if callable(parent) else None

    # -- forward --------------------------------------------------------------------

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        llama_4_scaling: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if (
            kwargs
            or self._k3_delegate
            or self.q_lora_rank is None
            or not isinstance(hidden_states, torch.Tensor)
        ):
            # A call shape this wrapper was not written for: the stock path, unchanged.
            type(self).counters["delegated"] += 1
            return super().forward(positions, hidden_states, llama_4_scaling, **kwargs)
        if not self._k3_finalized:
            self._k3_finalize()

        qkv_lora = self.fused_qkv_a_proj(hidden_states)[0]
        q_c, kv_lora = qkv_lora.split(
            [self.q_lora_rank, self.kv_lora_rank + self.qk_rope_head_dim], dim=-1
        )
        kv_c, k_pe = kv_lora.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        if self._k3_fuse_norm and not torch.compiler.is_compiling():
            q_c, kv_c_normed = torch.ops.vllm.fused_mla_dual_rms_norm(
                q_c,
                self.q_a_layernorm.weight,
                kv_c,
                self.kv_a_layernorm.weight,
                self.q_a_layernorm.variance_epsilon,
                self.kv_a_layernorm.variance_epsilon,
            )
            type(self).counters["qk_norm_fused"] += 1
        else:
            q_c = self.q_a_layernorm(q_c)
            kv_c_normed = self.kv_a_layernorm(kv_c)
            type(self).counters["qk_norm_stock"] += 1
        k_pe = k_pe.unsqueeze(1)

        q = self.q_b_proj(q_c)[0]
        heads = self.num_heads
        if self.dcp_q_replicate:
            heads *= self.q_b_proj.group_size
        q = q.view(-1, heads, self.qk_head_dim)

        if self.rotary_emb is not None:
            q[..., self.qk_nope_head_dim :], k_pe = self.rotary_emb(
                positions, q[..., self.qk_nope_head_dim :], k_pe
            )
        if llama_4_scaling is not None:
            q *= llama_4_scaling

        q_dcp_replicated = None
        if self.dcp_q_replicate:
            q_dcp_replicated, q = q, self.q_b_proj._local_view(q)

        output_shape = (hidden_states.shape[0], self.num_heads * self.v_head_dim)
        attn_out = None
        if self._k3_qprep and q_dcp_replicated is None:
            attn_out = self._k3_try_fused_decode(q, kv_c_normed, k_pe, positions, output_shape)
        if attn_out is None:
            type(self).counters["attn_stock"] += 1
            attn_out = self.mla_attn(
                q, kv_c_normed, k_pe, output_shape=output_shape,
                q_dcp_replicated=q_dcp_replicated,
            )

        if self.g_proj is not None:
            attn_out = attn_out * self.g_proj(hidden_states)[0].sigmoid()
        return self.o_proj(attn_out)[0]

    # -- decode Q-prep fusion -------------------------------------------------------

    def _k3_try_fused_decode(
        self,
        q: torch.Tensor,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        positions: torch.Tensor,
        output_shape: tuple[int, int],
    ) -> torch.Tensor | None:
        """Return the attention output for a decode-only batch, or None (stock path)."""
        attn = self.mla_attn
        md, layer, kv_cache, slot_mapping = _attention_context(attn.layer_name)
        if isinstance(kv_cache, (list, tuple)):  # older per-virtual-engine caches
            kv_cache = kv_cache[0]
        # The per-batch check: cheap attribute reads only.
        if (
            md is None
            or slot_mapping is None
            or kv_cache is None
            or kv_cache.numel() == 0
            or getattr(md, "num_prefills", 1) != 0
            or md.num_decode_tokens != md.num_actual_tokens
            or md.num_actual_tokens == 0
        ):
            return None
        n = md.num_actual_tokens
        fp8 = _fp8_dtype()
        q = q[:n]
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q_nope_t = q_nope.transpose(0, 1)  # (N, B, P)

        # W_UK: exactly the variant (and precedence) MLAAttention.forward_impl uses, so
        # ql_nope is what the stock path hands to its concat + quant.
        if attn.is_aiter_triton_fp4_bmm_enabled:
            from aiter.ops.triton.batched_gemm_a16wfp4 import batched_gemm_a16wfp4

            ql_nope = batched_gemm_a16wfp4(
                q_nope_t, attn.W_K, attn.W_K_scale, transpose_bm=True, prequant=True,
                y_scale=attn._q_scale,
            )
        else:
            w_uk_t = attn.W_UK_T
            ql_nope_nbl = q_nope_t.new_empty((q_nope_t.shape[0], n, w_uk_t.shape[-1]))
            torch.bmm(q_nope_t, w_uk_t, out=ql_nope_nbl)
            ql_nope = ql_nope_nbl.transpose(0, 1)

        rope = self._k3_identity_rope
        if rope is None:
            half = self.qk_rope_head_dim // 2
            # cos = 1, sin = 0: RoPE becomes the identity (MLA is NoPE in Kimi-K3).
            # One row: the kernel clamps positions into [0, 1).
            rope = (
                torch.ones((1, half), dtype=q.dtype, device=q.device),
                torch.zeros((1, half), dtype=q.dtype, device=q.device),
            )
            self._k3_identity_rope = rope

        if kv_cache.dtype != fp8:  # fp8 caches are allocated as uint8
            kv_cache = kv_cache.view(fp8)
        head_size = self.kv_lora_rank + self.qk_rope_head_dim
        q_out = torch.empty((n, q.shape[1], head_size), dtype=fp8, device=q.device)
        self._k3_caps.qprep_kernel(
            ql_nope.contiguous(),
            q_pe,
            kv_c_normed[:n],
            k_pe[:n].squeeze(1),
            kv_cache.view(kv_cache.shape[0], -1, head_size),
            q_out,
            slot_mapping[:n].flatten(),
            attn._k_scale,
            attn._q_scale,
            positions[:n],
            rope[0],
            rope[1],
            is_neox=True,  # irrelevant for the identity rotation
            is_nope_first=True,  # q_out = [ql_nope | q_pe]
        )
        attn_out, _lse = attn.impl.forward_mqa(q_out, kv_cache, md, attn)
        output = torch.empty(output_shape, dtype=q.dtype, device=q.device)
        attn._v_up_proj(attn_out, out=output[:n])
        type(self).counters["decode_qprep_fused"] += 1
        return output


def _attention_context(layer_name: str) -> tuple[Any, Any, Any, Any]:
    global _GET_CTX
    if _GET_CTX is None:
        from vllm.model_executor.layers.attention.attention import get_attention_context

        _GET_CTX = get_attention_context
    return _GET_CTX(layer_name)


_GET_CTX: Any = None


def _plain_rmsnorm(module: Any) -> bool:
    if module is None:
        return False
    weight = getattr(module, "weight", None)
    return (
        isinstance(weight, torch.Tensor)
        and hasattr(module, "variance_epsilon")
        and getattr(module, "variance_size_override", None) is None
        and getattr(module, "has_weight", True)
    )


def _fp8_dtype() -> torch.dtype:
    from vllm.platforms import current_platform

    return current_platform.fp8_dtype()


__all__ = [
    "K3ROCM_OVERLAY",
    "KimiK3MultiHeadLatentAttentionWrapper",
    "decide_decode_qprep",
    "decide_qk_norm",
    "probe_capabilities",
]
