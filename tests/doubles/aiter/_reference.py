"""TEST DOUBLE: torch reference implementations of the AITER kernels the overlay uses.

Written from the kernels' documented contracts (argument shapes, in-place outputs,
position clamp, slot < 0 rows skipped, static fp8 quantization with the given scales),
cross-checked against ROCm/aiter op_tests/test_concat_cache_mla.py (its torch reference:
q_out = [q_nope | rope(q_pe)] * (1/q_scale) as fp8 with nope first, the cache row gets
[kv_c | rope(k_pe)] * (1/k_scale), rows whose slot is < 0 are skipped), not copied from it.
They are the *kernels* of the AITER double (tests/doubles/aiter); which op is registered,
and with which schema, is decided by the double's aiter.ops modules, shaped like the real
ones.
"""

from __future__ import annotations

import torch

import aiter


def _qprep_member(q_nope: torch.Tensor, kv_cache: torch.Tensor) -> str:
    """Which device kernel the host API ``fused_qk_rope_concat_and_cache_mla`` launches
    (ROCm/aiter csrc/kernels/cache_kernels.cu): the
    per-head kernel for fewer than 256 tokens with block size 1 (AITER-MLA decode), the
    ``_opt`` kernel for kv_lora_rank 512, rope 64 and rank x heads >= 2048, else the general
    kernel, which does not clamp positions."""
    tokens, heads, rank = q_nope.shape
    if tokens < 256 and kv_cache.shape[1] == 1:
        return "aiter::fuse_qk_rope_concat_and_cache_mla_per_head_kernel"
    if rank == 512 and kv_cache.shape[-1] - rank == 64 and rank * heads >= 2048:
        return "aiter::fuse_qk_rope_concat_and_cache_mla_kernel"
    return "aiter::fuse_qk_rope_concat_and_cache_mla_kernel_general"

def _rows(pos: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
          member: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos/sin rows the device kernel reads for ``pos``, per AITER variant: ``clamp``
    clamps into [0, rows) in the per-head and ``_opt`` kernels; ``grouped`` (v0.1.26's
    head-grouped kernel) reads cos = sin = 0 past the cache at one head per block and faults
    at more; everything else reads the raw row (out of bounds: IndexError)."""
    rows = cos_cache.shape[0]
    cos, sin = cos_cache.to(torch.float32), sin_cache.to(torch.float32)
    out = (pos < 0) | (pos >= rows)
    if aiter.VARIANT == "clamp" and not member.endswith("_kernel_general"):
        pos = pos.clamp(0, rows - 1)
    elif aiter.VARIANT == "grouped" and aiter.GROUPED_HEADS_PER_BLOCK == 1:
        zero = torch.zeros(1, cos.shape[1], dtype=torch.float32)
        row = torch.where(out, rows, pos)  # row `rows`: the zeros past the cache
        return torch.cat((cos, zero))[row], torch.cat((sin, zero))[row]
    elif bool(out.any()):  # what the device kernel would read
        raise IndexError(f"position {int(pos.max())} outside the {rows}-row cos/sin cache "
                         f"({member} of AITER variant {aiter.VARIANT} does not clamp)")
    return cos[pos], sin[pos]


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with fp32 statistics; normalized value rounded to the input dtype, then
    scaled by the weight in that dtype (the order vLLM's RMSNorm uses)."""
    x32 = x.to(torch.float32)
    var = x32.pow(2).mean(dim=-1, keepdim=True)
    y = (x32 * torch.rsqrt(var + eps)).to(x.dtype)
    return y * weight.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX-style RoPE (the only style the overlay and vLLM's amd/mla.py ask for): x [..., D]
    float32; cos/sin [..., D/2] broadcastable."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _quant(x32: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Static per-tensor fp8: x * (1 / scale), saturated to the fp8 range."""
    finfo = torch.finfo(dtype)
    inv = scale.to(torch.float32).reshape(()).reciprocal()
    return (x32 * inv).clamp(finfo.min, finfo.max).to(dtype)


def fused_qk_rope_concat_and_cache_mla(
    q_nope: torch.Tensor,  # [T, H, L]
    q_pe: torch.Tensor,  # [T, H, R]
    kv_c: torch.Tensor,  # [T, L]
    k_pe: torch.Tensor,  # [T, R]
    kv_cache: torch.Tensor,  # [blocks, block_size, L + R], fp8-typed
    q_out: torch.Tensor,  # [T, H, L + R], fp8
    slot_mapping: torch.Tensor,  # [T]
    k_scale: torch.Tensor,
    q_scale: torch.Tensor,
    positions: torch.Tensor,  # [T]
    cos_cache: torch.Tensor,  # [rows, R/2]
    sin_cache: torch.Tensor,  # [rows, R/2]
    is_neox: bool,
    is_nope_first: bool,
    compute_all_q_rope: bool = False,
) -> None:
    """In place: RoPE on q_pe and k_pe at each token's position (cos/sin row ``position``,
    read as ``aiter.VARIANT`` reads it, see :func:`_rows`); q_out gets the fp8
    ``[q_nope | q_pe]`` (or pe first) quantized with q_scale; the cache row at each slot
    gets fp8 ``[kv_c | k_pe]`` quantized with k_scale. Rows with slot < 0 are skipped
    entirely (q_out untouched) unless compute_all_q_rope."""
    if kv_cache.dtype == torch.uint8:
        raise TypeError("kv_cache must be fp8-typed, not uint8 (view it as fp8 first)")
    if not is_neox:
        raise NotImplementedError("the double implements NeoX-style RoPE only")
    if q_out.dtype != kv_cache.dtype:
        raise TypeError(f"q_out dtype {q_out.dtype} != kv_cache dtype {kv_cache.dtype}")
    t = q_nope.shape[0]
    if not (q_pe.shape[0] == kv_c.shape[0] == k_pe.shape[0] == slot_mapping.shape[0] == t):
        raise ValueError("token counts differ between inputs")
    member = _qprep_member(q_nope, kv_cache)
    aiter.calls[member] += 1
    cos, sin = _rows(positions.to(torch.int64), cos_cache, sin_cache, member)  # [T, R/2]
    slots = slot_mapping.to(torch.int64)
    valid = slots >= 0
    q_rows = torch.ones_like(valid) if compute_all_q_rope else valid

    qpe = _rope(q_pe.to(torch.float32), cos[:, None, :], sin[:, None, :])
    qn = q_nope.to(torch.float32)
    q_full = torch.cat((qn, qpe) if is_nope_first else (qpe, qn), dim=-1)
    q_out[q_rows] = _quant(q_full[q_rows], q_scale, q_out.dtype)

    kpe = _rope(k_pe.to(torch.float32), cos, sin)
    kv = torch.cat((kv_c.to(torch.float32), kpe), dim=-1)
    block_size = kv_cache.shape[1]
    s = slots[valid]
    kv_cache[s // block_size, s % block_size] = _quant(kv[valid], k_scale, kv_cache.dtype)


def concat_and_cache_mla_ref(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale: torch.Tensor,
) -> None:
    """Reference of the unfused fp8 KV-cache write: ``[kv_c | k_pe] / scale`` into the
    slot rows, slot < 0 skipped (vLLM's kernel divides by the scale)."""
    if k_pe.dim() == 3:
        k_pe = k_pe.squeeze(1)
    kv = torch.cat((kv_c, k_pe), dim=-1).to(torch.float32)
    finfo = torch.finfo(kv_cache.dtype)
    q = (kv / scale.to(torch.float32).reshape(())).clamp(finfo.min, finfo.max)
    slots = slot_mapping.to(torch.int64)
    valid = slots >= 0
    s = slots[valid]
    block_size = kv_cache.shape[1]
    kv_cache[s // block_size, s % block_size] = q[valid].to(kv_cache.dtype)


def fused_qk_rope_concat_and_cache_mla_preclamp(*args, **kwargs) -> None:
    """The same kernel before ROCm/aiter PR #4342 (no compute_all_q_rope argument); its
    position handling is ``aiter.VARIANT``'s (``preclamp``: no clamp)."""
    fused_qk_rope_concat_and_cache_mla(*args, **kwargs)
