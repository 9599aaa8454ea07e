"""TEST DOUBLE: the decode routing of vLLM's AITER MLA backend, in two generations.

Modelled on ``vllm/v1/attention/backends/mla/rocm_aiter_mla.py`` (read from the wheels):

- ``V0271`` (vLLM 0.27.1, the pinned nightly's era): ``AiterMLAHelper.use_gluon_decode(
  num_heads, max_qo_len)`` = ``num_heads < 16 and max_qo_len == 1`` (line 829, no dtype
  argument); a < 16-head multi-token verify is flattened onto the same Gluon kernel
  (``AiterMLAImpl.forward_mqa``, lines 1111-1185); ``get_actual_mla_num_heads`` =
  ``max(num_heads, 16)`` (line 807).
- ``V033`` (vLLM 0.33.0): ``use_gluon_decode(num_heads, max_qo_len, kv_cache_dtype,
  kv_cache_bytes=None)`` never sends a quantized KV cache to Gluon (line 2129, "Gluon's only
  fp8-KV regime, bh16bn128, is a bf16-query kernel ..."), ``use_gluon_verify`` likewise;
  ``get_actual_mla_num_heads`` rounds up to a multiple of 16; ``get_mla_padded_q`` returns
  ``q.as_strided(...)`` when ``q.stride(0) == m * q.stride(1)`` (a view of an m-head buffer)
  and ``q.repeat(1, reps, 1)[:, :m, :].contiguous()`` for a dense non-divisor query (lines
  2084-2107; 0.32.0 has only the copy).

AITER's Gluon kernel asserts a bf16 query (``aiter/ops/triton/gluon/mla_gluon.py`` at
v0.1.19: "q_nope/q_pe must be bf16"; vLLM PR #50563 quotes it for Kimi-K3 at TP8). The
asm decode (``mla_decode_fwd``) takes the padded query. Arch and mode knobs
(``VLLM_ROCM_AITER_MLA_ASM_PADDING``, gfx950) are fixed at their gfx950 ``auto`` answer.

``impl_class(base, gen)`` makes a subclass of the layer's real impl class that lives in this
module (the overlay finds ``AiterMLAHelper`` beside the impl's class, as it does in vLLM) and
whose ``forward_mqa`` takes the route; routes taken are appended to ``ROUTES``.
"""

from __future__ import annotations

import torch

MIN_HEADS = 16
ROUTES: list[dict] = []


class _V0271:
    @staticmethod
    def use_gluon_decode(num_heads: int, max_qo_len: int) -> bool:
        return num_heads < MIN_HEADS and max_qo_len == 1

    @staticmethod
    def get_actual_mla_num_heads(num_heads: int) -> int:
        return max(num_heads, MIN_HEADS)

    @staticmethod
    def get_mla_padded_q(num_heads: int, q: torch.Tensor) -> torch.Tensor:
        return q if num_heads >= MIN_HEADS else q.repeat_interleave(MIN_HEADS // num_heads, 1)


class _V033:
    @staticmethod
    def use_gluon_decode(num_heads: int, max_qo_len: int, kv_cache_dtype: str,
                         kv_cache_bytes: int | None = None) -> bool:
        if num_heads >= MIN_HEADS or max_qo_len != 1 or kv_cache_dtype.startswith("fp8"):
            return False
        return MIN_HEADS % num_heads == 0  # gfx950, mode auto

    @staticmethod
    def use_gluon_verify(num_heads: int, max_qo_len: int, kv_cache_dtype: str,
                         dcp_world_size: int = 1, causal: bool = True,
                         kv_cache_bytes: int | None = None) -> bool:
        return (max_qo_len > 1 and num_heads < MIN_HEADS
                and not kv_cache_dtype.startswith("fp8"))

    @staticmethod
    def get_actual_mla_num_heads(num_heads: int) -> int:
        return -(-num_heads // MIN_HEADS) * MIN_HEADS

    @staticmethod
    def get_mla_padded_q(num_heads: int, q: torch.Tensor) -> torch.Tensor:
        m = _V033.get_actual_mla_num_heads(num_heads)
        if num_heads == m or q.shape[1] == m:
            return q
        if m % num_heads == 0:
            return q.repeat_interleave(m // num_heads, dim=1)
        if q.stride(0) == m * q.stride(1):
            return q.as_strided((q.shape[0], m, q.shape[2]), q.stride())
        reps = -(-m // num_heads)
        return q.repeat(1, reps, 1)[:, :m, :].contiguous()


GENERATIONS = {"0.27.1": _V0271, "0.33": _V033}
AiterMLAHelper = _V0271  # rebound by impl_class(); the overlay reads this module attribute


def _gluon(q: torch.Tensor) -> None:
    if q.dtype != torch.bfloat16:
        raise AssertionError(f"q_nope/q_pe must be bf16, got {q.dtype}")


def impl_class(base: type, gen: str) -> type:
    """A subclass of the real impl ``base`` routed like vLLM ``gen``'s AiterMLAImpl."""
    global AiterMLAHelper
    helper = AiterMLAHelper = GENERATIONS[gen]

    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)
        heads = self.num_heads
        qlen = attn_metadata.num_decode_tokens // max(attn_metadata.num_decodes, 1)
        kv_dtype = str(layer.kv_cache_dtype)
        gluon = (helper.use_gluon_decode(heads, qlen, kv_dtype) if helper is _V033 else
                 helper.use_gluon_decode(heads, qlen))
        if not gluon and qlen > 1 and heads < MIN_HEADS:
            gluon = (helper.use_gluon_verify(heads, qlen, kv_dtype) if helper is _V033
                     else True)  # 0.27.1 flattens the verify block onto Gluon
        if gluon:
            ROUTES.append({"route": "gluon", "q": q.dtype, "heads": heads})
            _gluon(q)
            return q[..., :self.kv_lora_rank].to(torch.bfloat16).contiguous(), None
        # The padding is the backend's own work (its launches count); the kernel is one.
        padded = helper.get_mla_padded_q(heads, q)
        m = helper.get_actual_mla_num_heads(heads)
        assert padded.shape[1] == m and padded.stride(0) == m * padded.stride(1), padded.shape
        ROUTES.append({"route": "asm", "q": q.dtype, "heads": heads,
                       "copied": padded.data_ptr() != q.data_ptr()})
        with torch.profiler.record_function("test::aiter_mla_decode_fwd (asm)"):
            o = padded[..., :self.kv_lora_rank].to(torch.bfloat16)
        return o[:, :heads].contiguous(), None

    return type("AiterMLAImpl", (base,), {"forward_mqa": forward_mqa, "__module__": __name__})
