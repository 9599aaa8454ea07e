# TEST DATA: the signature of AITER's Q-prep stub at ROCm/aiter tag v0.1.19.post1, the first
# tag with the position clamp (ROCm/aiter PR #4342, commit 770790cd96, "Fix
# fused_qk_rope_concat_and_cache_mla for DCP", which added `compute_all_q_rope: bool = False`;
# parameter names and order as there, body elided).
def fused_qk_rope_concat_and_cache_mla(q_nope, q_pe, kv_c, k_pe, kv_cache, q_out,
                                       slot_mapping, k_scale, q_scale, positions, cos_cache,
                                       sin_cache, is_neox, is_nope_first,
                                       compute_all_q_rope=False): ...
