"""TEST DOUBLE of ROCm/aiter ``aiter/ops/cache.py``: the Q-prep op's stub, both generations
(``grouped``, AITER v0.1.26, has the newer one).

Stub signatures as in ROCm/aiter (interfaces, for the schema): before PR #4342 the
argument list ends at ``is_nope_first``; from it on, ``compute_all_q_rope: bool = False``
follows (False, non-DCP: slot < 0 tokens skip Q RoPE and q_out; True, DCP: all tokens).
"""

from torch import Tensor

from aiter import VARIANT
from aiter.jit.core import compile_ops

if VARIANT != "preclamp":

    @compile_ops("module_cache")
    def fused_qk_rope_concat_and_cache_mla(
        q_nope: Tensor,
        q_pe: Tensor,
        kv_c: Tensor,
        k_pe: Tensor,
        kv_cache: Tensor,
        q_out: Tensor,
        slot_mapping: Tensor,
        k_scale: Tensor,
        q_scale: Tensor,
        positions: Tensor,
        cos_cache: Tensor,
        sin_cache: Tensor,
        is_neox: bool,
        is_nope_first: bool,
        compute_all_q_rope: bool = False,
    ) -> None: ...

else:

    @compile_ops("module_cache", fc_name="fused_qk_rope_concat_and_cache_mla_preclamp")
    def fused_qk_rope_concat_and_cache_mla(
        q_nope: Tensor,
        q_pe: Tensor,
        kv_c: Tensor,
        k_pe: Tensor,
        kv_cache: Tensor,
        q_out: Tensor,
        slot_mapping: Tensor,
        k_scale: Tensor,
        q_scale: Tensor,
        positions: Tensor,
        cos_cache: Tensor,
        sin_cache: Tensor,
        is_neox: bool,
        is_nope_first: bool,
    ) -> None: ...
