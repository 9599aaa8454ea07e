"""TEST DOUBLE of ROCm/aiter ``aiter/ops/fused_qk_norm_rope_cache_quant.py``
``_fused_qk_rmsnorm``, called the way vLLM's ``vllm/_aiter_ops.py``
``_fused_mla_dual_rms_norm_impl`` calls it (keywords q_out, q, q_weight, q_eps, k_out, k,
k_weight, k_eps). One launch of the device kernel ``aiter::fused_qk_rmsnorm_kernel``."""

import aiter
from aiter._reference import rms_norm_ref


def _fused_qk_rmsnorm(q_out=None, q=None, q_weight=None, q_eps=1e-6, k_out=None, k=None,
                      k_weight=None, k_eps=1e-6):
    aiter.calls["aiter::fused_qk_rmsnorm_kernel"] += 1
    return rms_norm_ref(q, q_weight, q_eps), rms_norm_ref(k, k_weight, k_eps)
