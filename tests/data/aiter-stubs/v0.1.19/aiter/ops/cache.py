# TEST DATA: the signature of AITER's Q-prep stub at ROCm/aiter tag v0.1.19
# (aiter/ops/cache.py, `fused_qk_rope_concat_and_cache_mla`, line 157; parameter names and
# order as there, body elided). The op's schema is defined from this stub by compile_ops.
def fused_qk_rope_concat_and_cache_mla(q_nope, q_pe, kv_c, k_pe, kv_cache, q_out,
                                       slot_mapping, k_scale, q_scale, positions, cos_cache,
                                       sin_cache, is_neox, is_nope_first): ...
