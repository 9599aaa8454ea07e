"""TEST DOUBLE: make the CPU build of vLLM answer like vLLM on ROCm with AITER enabled.

What it changes, each the way the real ROCm build does it (vLLM 0.27.1/0.33
``vllm/_aiter_ops.py``):
- ``rocm_aiter_ops.is_enabled()`` / ``is_mla_enabled()`` return True (on ROCm with
  ``VLLM_ROCM_USE_AITER=1`` they read ``_AITER_ENABLED`` / ``_MLA_ENABLED``; off ROCm the
  ``if_aiter_supported`` decorator makes them return None);
- ``vllm::fused_mla_dual_rms_norm(Tensor x1, Tensor x1_weight, Tensor x2, Tensor x2_weight,
  float x1_epsilon, float x2_epsilon) -> (Tensor, Tensor)`` is registered with
  ``direct_register_custom_op(op_name="fused_mla_dual_rms_norm", mutates_args=[])`` and
  calls AITER's ``aiter.ops.fused_qk_norm_rope_cache_quant._fused_qk_rmsnorm`` with the
  keywords vLLM uses (``rocm_aiter_ops.register_ops_once()`` does this at import on ROCm);
- optionally (``platform=True``, in-process tests only) ``current_platform.is_rocm()``, answered
  True to the overlay's code only (a caller whose module carries ``K3ROCM_OVERLAY``): vLLM's
  own ROCm paths, some taken while its modules import (the overlay file imports vLLM's
  layers before its probe asks), call CUDA and crash on CPU, so they keep seeing CPU.

The overlay's probe is production code and runs unmodified against this; nothing here
answers a question on the overlay's behalf. AITER itself is the double in
``tests/doubles/aiter`` (put this directory on PYTHONPATH).
"""

from __future__ import annotations

import sys
from typing import Any

import torch


def _impl(x1: torch.Tensor, x1_weight: torch.Tensor, x2: torch.Tensor,
          x2_weight: torch.Tensor, x1_epsilon: float,
          x2_epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    from aiter.ops.fused_qk_norm_rope_cache_quant import _fused_qk_rmsnorm

    return _fused_qk_rmsnorm(q_out=None, q=x1, q_weight=x1_weight, q_eps=x1_epsilon,
                             k_out=None, k=x2, k_weight=x2_weight, k_eps=x2_epsilon)


def _fake(x1: torch.Tensor, x1_weight: torch.Tensor, x2: torch.Tensor,
          x2_weight: torch.Tensor, x1_epsilon: float,
          x2_epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x1), torch.empty_like(x2)


def register_dual_norm_op() -> None:
    if hasattr(torch.ops.vllm, "fused_mla_dual_rms_norm"):
        return
    from vllm.utils.torch_utils import direct_register_custom_op

    direct_register_custom_op(op_name="fused_mla_dual_rms_norm", op_func=_impl,
                              mutates_args=[], fake_impl=_fake)


def _rocm_to_the_overlay(self: Any = None) -> bool:
    return bool(sys._getframe(1).f_globals.get("K3ROCM_OVERLAY"))


def activate(platform: bool = False) -> Any:
    """Apply the double in this process; returns a function that undoes the switches (the
    registered op stays: torch cannot unregister it, as on ROCm it never goes away)."""
    from vllm._aiter_ops import rocm_aiter_ops
    from vllm.platforms import current_platform

    saved = {n: rocm_aiter_ops.__dict__[n] for n in ("is_enabled", "is_mla_enabled")}
    rocm_aiter_ops.is_enabled = classmethod(lambda cls: True)
    rocm_aiter_ops.is_mla_enabled = classmethod(lambda cls: True)
    plat_cls = type(current_platform)
    saved_rocm = plat_cls.__dict__.get("is_rocm")
    if platform:
        plat_cls.is_rocm = _rocm_to_the_overlay
    register_dual_norm_op()

    def undo() -> None:
        for name, value in saved.items():
            setattr(rocm_aiter_ops, name, value)
        if platform:
            if saved_rocm is None:
                del plat_cls.is_rocm
            else:
                plat_cls.is_rocm = saved_rocm

    return undo
