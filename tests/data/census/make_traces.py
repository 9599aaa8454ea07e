"""Write the small crafted traces in this directory (run: python3 make_traces.py).

They imitate vLLM worker traces from a ROCm build: per engine step a ``user_annotation``
``execute_context_<n>(..)_generation_<m>(..)`` on the worker's main thread, host-side
``hipLaunchKernel`` runtime events inside it, and ``kernel`` events on a GPU stream linked by
``args.correlation``. Device kernels run *after* their launch, so the last kernels of a step
end after the step's annotation closed (attribution must use the correlation, not time).
Kernel names are the ROCm ones named in the brief, with C++ template/argument noise.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
K_FUSED_NORM = "aiter::fused_qk_rmsnorm_kernel<__hip_bfloat16, 256, 8>(__hip_bfloat16*, ...)"
K_FUSED_QPREP = ("void aiter::fused_qk_rope_concat_and_cache_mla_kernel<__hip_bfloat16, "
                 "__hip_fp8_e4m3, 64, true>(__hip_bfloat16 const*, long, int)")
K_CACHE = ("void vllm::concat_and_cache_mla_kernel<__hip_bfloat16, unsigned char, "
           "(vllm::Fp8KVCacheDataType)1>(__hip_bfloat16 const*, __hip_bfloat16 const*, "
           "unsigned char*, long const*, int, int, int, int, int, float const*)")
K_RMS = ("void vllm::rms_norm_kernel<c10::BFloat16, 8, 4>(c10::BFloat16*, "
         "c10::BFloat16 const*, float, int, int)")
K_ADD_RMS = ("void vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8>(c10::BFloat16*, "
             "c10::BFloat16*, c10::BFloat16 const*, float, int, int)")
K_GEMM = "Cijk_Alik_Bljk_BBS_BH_MT128x128x64_MI16x16x1_SN_1LDSB1_GRVW8"
K_ATTN = "void aiter::mla_decode_stage1_asm_fwd<(anonymous namespace)::Cfg, 512>(void*)"
K_QUANT = "void vllm::scaled_fp8_quant_kernel_strided<c10::BFloat16, c10::Float8_e4m3fnuz>(...)"


def _step_kernels(layers: int, decode: bool, norm_on: bool, qprep_on: bool) -> list[tuple]:
    """(kernel name, device us, enclosing cpu_op) in launch order for one engine step."""
    ks: list[tuple] = [(K_RMS, 3.0, "_C::rms_norm")]  # layer 0 input norm (no residual)
    for layer in range(layers):
        if layer:
            ks.append((K_ADD_RMS, 3.5, "_C::fused_add_rms_norm"))
        ks.append((K_GEMM, 20.0, "aten::mm"))  # fused_qkv_a_proj
        if norm_on:
            ks.append((K_FUSED_NORM, 4.0, "vllm::fused_mla_dual_rms_norm"))
        else:
            ks.append((K_RMS, 2.5, "_C::rms_norm"))
            ks.append((K_RMS, 2.6, "_C::rms_norm"))
        ks.append((K_GEMM, 15.0, "aten::mm"))  # q_b_proj
        if decode and qprep_on:
            ks.append((K_FUSED_QPREP, 4.7417, "aiter::fused_qk_rope_concat_and_cache_mla"))
        else:
            ks.append((K_CACHE, 4.6, "_C_cache_ops::concat_and_cache_mla"))
            # the query's fp8 quant runs inside the MLA attention operator
            ks.append((K_QUANT, 4.7875,
                       "vllm::unified_mla_attention_with_output>_C::static_scaled_fp8_quant"))
        ks.append((K_ATTN, 30.0, "vllm::unified_mla_attention_with_output"))
        ks.append((K_ADD_RMS, 3.5, "_C::fused_add_rms_norm"))
        ks.append((K_GEMM, 40.0, "aten::mm"))  # MLP
    ks.append((K_ADD_RMS, 3.5, "_C::fused_add_rms_norm"))  # final norm
    return ks


def make_trace(rank: int, layers: int, steps: list[tuple[int, int]], norm_on: bool,
               qprep_on: bool, extra_fused_norm: int = 0) -> dict:
    """``steps``: (context requests, generation requests) per engine step."""
    pid, tid = 4000 + rank, 4000 + rank
    ev: list[dict] = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
         "args": {"name": "VLLM::Worker"}},
        {"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": "Spans",
         "tid": "PyTorch Profiler", "ts": 1000.0, "dur": 1e7},
    ]
    t = 10_000.0
    corr = 1000
    gpu_t = t
    for si, (ctx, gen) in enumerate(steps):
        decode = ctx == 0
        name = (f"execute_context_{ctx}({ctx * 128})_generation_{gen}({gen * 3})")
        ks = _step_kernels(layers, decode, norm_on, qprep_on)
        if extra_fused_norm and si == 0:
            ks.append((K_FUSED_NORM, 4.0, "vllm::fused_mla_dual_rms_norm"))
        start = t
        for kname, kdur, opname in ks:
            corr += 1
            for depth, op in enumerate(opname.split(">")):
                ev.append({"ph": "X", "cat": "cpu_op", "name": op, "pid": pid, "tid": tid,
                           "ts": t + 0.2 * depth, "dur": 6.0 - 0.4 * depth,
                           "args": {"External id": corr}})
            ev.append({"ph": "X", "cat": "cuda_runtime", "name": "hipLaunchKernel", "pid": pid,
                       "tid": tid, "ts": t + 1.0, "dur": 4.0, "args": {"correlation": corr}})
            gpu_t = max(gpu_t, t + 5.0)
            ev.append({"ph": "X", "cat": "kernel", "name": kname, "pid": 0, "tid": 7,
                       "ts": gpu_t, "dur": kdur,
                       "args": {"correlation": corr, "device": 0, "stream": 7,
                                "kernel": kname}})
            gpu_t += kdur + 0.5
            t += 7.0
        ev.append({"ph": "X", "cat": "user_annotation", "name": name, "pid": pid, "tid": tid,
                   "ts": start - 1.0, "dur": t - start + 2.0})
        t += 50.0
    # a kernel outside any step (e.g. the sampler after the last step)
    corr += 1
    ev.append({"ph": "X", "cat": "kernel", "name": K_GEMM, "pid": 0, "tid": 7, "ts": gpu_t + 100,
               "dur": 5.0, "args": {"correlation": corr}})
    return {"schemaVersion": 1, "distributedInfo": {"backend": "nccl", "rank": rank,
                                                     "world_size": 2},
            "deviceProperties": [{"id": 0, "name": "AMD Instinct MI355X"}],
            "vllm_version": "0.26.1rc1.dev306+gcb8104839", "traceEvents": ev}


def write(path: Path, obj: dict, gz: bool) -> None:
    data = json.dumps(obj, separators=(",", ":")).encode()
    if gz:
        data = gzip.compress(data, mtime=0)
    path.write_bytes(data)


def main() -> None:
    steps = [(0, 8)] * 6
    for state, norm_on, qprep_on in (("on", True, True), ("off", False, False)):
        d = HERE / f"rocm-{state}"
        d.mkdir(exist_ok=True)
        for rank in (0, 1):
            write(d / f"1764700000-rank-{rank}.1764700001.pt.trace.json.gz",
                  make_trace(rank, 3, steps, norm_on, qprep_on), gz=True)
        # the front-end trace (no engine steps) that the census must ignore
        write(d / "1764700000.async_llm.1764700001.pt.trace.json.gz",
              {"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "AsyncLLM.generate",
                                "pid": 1, "tid": 1, "ts": 1.0, "dur": 2.0}]}, gz=True)
    # plain JSON, one mixed (prefill + decode) step first, fusions on
    d = HERE / "rocm-mixed-plain"
    d.mkdir(exist_ok=True)
    write(d / "dp0_pp0_tp0_dcp0_ep0_rank0.1764700002.pt.trace.json",
          make_trace(0, 3, [(1, 7)] + [(0, 8)] * 4, True, True), gz=False)
    # the upstream anchor's shape: rank 0, 24 MLA layers, 6 decode steps (Kimi-K3 config)
    for state, on in (("on", True), ("off", False)):
        d = HERE / f"k3-anchor-{state}"
        d.mkdir(exist_ok=True)
        write(d / "dp0_pp0_tp0_dcp0_ep0_rank0.1764700003.pt.trace.json.gz",
              make_trace(0, 24, steps, on, on), gz=True)
    # fusions on, but one fused norm too many on rank 1
    d = HERE / "rocm-bad"
    d.mkdir(exist_ok=True)
    for rank in (0, 1):
        write(d / f"1764700000-rank-{rank}.1764700001.pt.trace.json.gz",
              make_trace(rank, 3, steps, True, True, extra_fused_norm=1 if rank else 0),
              gz=True)


if __name__ == "__main__":
    main()
