"""Write the crafted traces and decision records in this directory (python3 make_traces.py;
deterministic). They imitate ROCm vLLM worker traces: per step a ``user_annotation``, host
``hipLaunchKernel`` events nested in ``cpu_op``s, ``kernel`` events linked by
``args.correlation`` that may end after the step closed, and ``distributedInfo``. Kernel names
are the real ROCm names (sources: src/k3rocm/checks/census/kernels.json). Name forms:
"demangled" (kineto CUPTI/roctracer) and "rocprof-sdk" (`` [clone .kd]``, ``.kd``). The
k3-anchor-* sets carry the upstream PR's counts and durations (288 -> 144 launches; Q-prep
1351.8 -> 682.8 us on rank 0, TP=8, 6 decode steps, 24 MLA layers).
"""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent
K_FUSED_NORM = ("void aiter::fused_qk_rmsnorm_kernel<__hip_bfloat16, 256, 8, true, 1>"
                "(__hip_bfloat16*, __hip_bfloat16*, __hip_bfloat16 const*, "
                "__hip_bfloat16 const*, float, float, int, int, int)")
K_NORM = ("void aiter::add_rmsnorm_quant_kernel<__hip_bfloat16, __hip_bfloat16, 256, 8, false>"
          "(__hip_bfloat16*, __hip_bfloat16*, float*, __hip_bfloat16 const*, "
          "__hip_bfloat16 const*, __hip_bfloat16 const*, double, int, int, int, int, int)")
K_QPREP = {
    "per_head": ("void aiter::fuse_qk_rope_concat_and_cache_mla_per_head_kernel<__hip_bfloat16, "
                 "__hip_fp8_e4m3, __hip_fp8_e4m3, (vllm::Fp8KVCacheDataType)1, "
                 "(vllm::Fp8KVCacheDataType)1, false, true>(__hip_bfloat16 const*, ...)"),
    "opt": ("void aiter::fuse_qk_rope_concat_and_cache_mla_kernel<__hip_bfloat16, "
            "__hip_fp8_e4m3, __hip_fp8_e4m3, (vllm::Fp8KVCacheDataType)1, "
            "(vllm::Fp8KVCacheDataType)1, false, true>(__hip_bfloat16 const*, ...)"),
    "general": ("void aiter::fuse_qk_rope_concat_and_cache_mla_kernel_general<__hip_bfloat16, "
                "__hip_fp8_e4m3, __hip_fp8_e4m3, (vllm::Fp8KVCacheDataType)1, "
                "(vllm::Fp8KVCacheDataType)1>(__hip_bfloat16 const*, ...)"),
}
K_CACHE = ("void vllm::concat_and_cache_mla_kernel<__hip_bfloat16, unsigned char, "
           "(vllm::Fp8KVCacheDataType)1>(__hip_bfloat16 const*, __hip_bfloat16 const*, "
           "unsigned char*, long const*, int, int, int, int, int, float const*)")
K_CONCAT_QUANT = "triton_poi_fused__to_copy_cat_clamp_mul_reciprocal_view_0"
K_GEMM = "Cijk_Alik_Bljk_BBS_BH_MT128x128x64_MI16x16x1_SN_1LDSB1_GRVW8"
K_MLA = "aiter::mla_a8w8_qh16_qseqlen1_gqaratio16_ps"
K_MLA_REDUCE = "kn_mla_reduce_v1_ps<512, 32, 1>"
K_KDA = "chunk_kda_fwd_kernel"  # stands for a KDA layer's attention work (not a role)
OP_NORM = "vllm::rocm_aiter_rms_norm"
OP_MLA = "vllm::unified_mla_attention_with_output"

# upstream anchor durations (us): stock Q-prep 9.3875 per layer and step (x 144 = 1351.8),
# fused 682.8 / 144
US_CACHE, US_CONCAT, US_FUSED_QPREP = 4.6, 4.7875, 682.8 / 144


def name_in_form(name: str, form: str) -> str:
    """A kernel name as the profiler backend ``form`` spells it (see the module docstring)."""
    if form == "demangled":
        return name
    if form == "rocprof-sdk":
        return name + (" [clone .kd]" if name.endswith(")") else ".kd")
    raise ValueError(form)


def _mla_layer(decode: bool, norm: str, qprep: str, member: str) -> list[tuple]:
    """One MLA layer's launches: (kernel, device us, enclosing cpu_op path 'a>b')."""
    ks: list[tuple] = [(K_GEMM, 20.0, "aten::mm")]  # fused_qkv_a_proj
    if norm in ("on", "both"):
        ks.append((K_FUSED_NORM, 4.0, "vllm::fused_mla_dual_rms_norm"))
    if norm in ("off", "both"):  # the paired per-MLA q/kv latent norms, then q_b_proj
        # (q_a_layernorm and kv_a_layernorm back to back: vllm@0.27.1
        # model_executor/layers/mla.py:175,190; vllm@0.34.0 models/kimi_k3/amd/mla.py:131)
        ks += [(K_NORM, 2.5, OP_NORM), (K_NORM, 2.6, OP_NORM), (K_GEMM, 15.0, "aten::mm")]
    else:
        ks.append((K_GEMM, 15.0, "aten::mm"))  # q_b_proj
    if decode and qprep == "on":
        ks.append((K_QPREP[member], US_FUSED_QPREP, "aiter::fused_qk_rope_concat_and_cache_mla"))
        ks.append((K_MLA, 30.0, OP_MLA))
    else:
        ks.append((K_CACHE, US_CACHE, "_C_cache_ops::concat_and_cache_mla"))
        if decode:  # the query's concat + fp8 quant: one Inductor kernel in the MLA op
            ks.append((K_CONCAT_QUANT, US_CONCAT, OP_MLA + ">vllm::mla_decode_concat_quant_fp8"))
        ks.append((K_MLA, 30.0, OP_MLA))
    ks.append((K_MLA_REDUCE, 3.0, OP_MLA))
    return ks


def _step_kernels(mla: list[int], layers: int, decode: bool, norm: str, qprep: str,
                  member: str) -> list[tuple]:
    """Launch order of one engine step: per layer input norm, attention (MLA or KDA), post
    norm; a final norm. Other RMSNorms per step = 2 * layers + 1."""
    ks: list[tuple] = []
    for layer in range(layers):
        ks.append((K_NORM, 3.0, OP_NORM))  # input_layernorm (+ residual add after layer 0)
        if layer in mla:
            ks += _mla_layer(decode, norm, qprep, member)
        else:
            ks.append((K_KDA, 10.0, "vllm::kda_attention"))
        ks.append((K_NORM, 3.5, OP_NORM))  # post_attention_layernorm
        ks.append((K_GEMM, 40.0, "aten::mm"))  # MLP / MoE
    ks.append((K_NORM, 3.5, OP_NORM))  # final norm
    return ks


def make_trace(rank: int | None, world: int | None, mla: list[int], layers: int,
               steps: list[tuple[int, int]], norm: str, qprep: str,
               member: str = "per_head", bad_ts: bool = False,
               name_form: str = "demangled", drop=None, graph: bool = False,
               base_ns: int | None = None, t0: float = 10_000.0,
               rename: dict | None = None, unlinked_queues: int = 0,
               stock_steps: tuple[int, ...] = (), step_spans: bool = True) -> dict:
    pid = tid = 4000 + (rank or 0)
    ev: list[dict] = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
         "args": {"name": "VLLM::Worker"}},
    ]
    t = t0
    corr = 1000
    gpu_t = t
    for step_no, (ctx, gen, *more) in enumerate(steps):
        decode = ctx == 0 and not more
        replay = graph and decode and gen > 0
        name = f"execute_context_{ctx}({ctx * 128})_generation_{gen}({gen * 3 + sum(more)})"
        q_first: dict[int, float] = {}
        q_last: dict[int, float] = {}
        stock = step_no in stock_steps
        ks = [] if ctx == 0 and gen == 0 else _step_kernels(
            mla, layers, decode, "off" if stock else norm, "off" if stock else qprep, member)
        start = t
        if replay:
            corr += 1
            ev.append({"ph": "X", "cat": "cuda_runtime", "name": "hipGraphLaunch", "pid": pid,
                       "tid": tid, "ts": round(t + 1.0, 3), "dur": 4.0,
                       "args": {"correlation": corr}})
        for i, (kname, kdur, opname) in enumerate(ks):
            if unlinked_queues:
                corr += 1
                queue = 7 + i % unlinked_queues
            elif not replay:
                corr += 1
                for depth, op in enumerate(opname.split(">")):
                    ev.append({"ph": "X", "cat": "cpu_op", "name": op, "pid": pid, "tid": tid,
                               "ts": round(t + 0.2 * depth, 3),
                               "dur": round(6.0 - 0.4 * depth, 3)})
                ev.append({"ph": "X", "cat": "cuda_runtime", "name": "hipLaunchKernel",
                           "pid": pid, "tid": tid, "ts": round(t + 1.0, 3), "dur": 4.0,
                           "args": {"correlation": corr}})
            gpu_t = max(gpu_t, t + 5.0)
            if unlinked_queues:
                q_first.setdefault(queue, gpu_t)
                q_last[queue] = gpu_t + kdur
                ev.append({"ph": "X", "cat": "kernel", "name": name_in_form(kname, name_form),
                           "pid": 0, "tid": queue, "ts": round(gpu_t, 3),
                           "dur": round(kdur, 6), "args": {"device": 0, "stream": queue}})
            elif drop is None or not drop(step_no, i):
                kname = (rename or {}).get(kname, kname)
                ev.append({"ph": "X", "cat": "kernel", "name": name_in_form(kname, name_form),
                           "pid": 0, "tid": 7,
                           "ts": round(gpu_t, 3), "dur": round(kdur, 6),
                           "args": {"correlation": corr, "device": 0, "stream": 7}})
            gpu_t += kdur + 0.5
            t += 7.0
        ev.append({"ph": "X", "cat": "user_annotation", "name": name, "pid": pid, "tid": tid,
                   "ts": round(start - 1.0, 3), "dur": round(t - start + 2.0, 3)})
        for queue, first in (q_first if step_spans else {}).items():
            ev.append({"ph": "X", "cat": "gpu_user_annotation", "name": name, "pid": 0,
                       "tid": queue, "ts": round(first - 0.1, 3),
                       "dur": round(q_last[queue] - first + 0.2, 3)})
        t += 50.0
    # a kernel outside any step (the sampler after the last step)
    corr += 1
    ev.append({"ph": "X", "cat": "kernel", "name": K_GEMM, "pid": 0, "tid": 7,
               "ts": round(gpu_t + 100, 3), "dur": 5.0, "args": {"correlation": corr}})
    if bad_ts:
        ev[-1]["ts"] = "12:00:01"
    out: dict = {"schemaVersion": 1,
                 "deviceProperties": [{"id": 0, "name": "AMD Instinct MI355X"}],
                 "vllm_version": "0.26.1rc1.dev306+gcb8104839", "traceEvents": ev}
    if rank is not None:
        out["distributedInfo"] = {"backend": "nccl", "rank": rank, "world_size": world}
    if base_ns is not None:
        out["baseTimeNanoseconds"] = base_ns
    return out


def upstream_record(pid: int, tp_rank: int, qk: str, qprep: str, asked: tuple[bool, bool],
                    qprep_why: str = "", kind: str = "target", vllm: str = "0.32.0") -> dict:
    def why(state: str, env: str, attr: str, given: str = "") -> str:
        if state == "unknown":
            return given or (f"KimiK3MultiHeadLatentAttentionWrapper has no {attr} (vLLM "
                             f"{vllm}); upstream untouched")
        return given or (f"{env}=0 (hook)" if state == "off" and not asked[0 if env.endswith(
            "NORM") else 1] else f"upstream's gates: {state}")

    return {
        "schema": "k3rocm.overlay.decision/1", "pid": pid,
        "process": f"VllmWorker TP{tp_rank}", "tp_rank": tp_rank, "layer_kind": kind,
        "phase": "construct", "vllm_version": vllm, "writer": "upstream",
        "fusions": {
            "qk_norm": {"state": qk, "reason": why(qk, "K3_FUSE_QK_NORM",
                                                   "_use_eager_qk_rmsnorm_fusion")},
            "decode_qprep": {"state": qprep, "reason": why(qprep, "K3_FUSE_DECODE_QPREP",
                                                           "_fused_qk_prep", qprep_why)}},
        "asked": {"qk_norm": asked[0], "decode_qprep": asked[1]},
    }


def record(pid: int, tp_rank: int, qk: str, qprep: str, asked: tuple[bool, bool],
           phase: str = "load", kind: str = "target", qk_why: str = "",
           qprep_why: str = "") -> dict:
    """One overlay decision record (format: /work/helpers/DECISIONS.md, docs/census.md)."""
    return {
        "schema": "k3rocm.overlay.decision/1", "pid": pid,
        "process": f"VllmWorker TP{tp_rank}", "tp_rank": tp_rank, "layer_kind": kind,
        "phase": phase, "vllm_version": "0.26.1rc1.dev306+gcb8104839",
        "fusions": {
            "qk_norm": {"state": qk, "reason": qk_why or (
                "fused_mla_dual_rms_norm (op source: aiter)" if qk == "on"
                else "K3_FUSE_QK_NORM=0")},
            "decode_qprep": {"state": qprep, "reason": qprep_why or {
                "on": "all gates hold (kernel clamps positions)",
                "needs-model": "the W_UK variant and the backend's query dtype are known "
                               "after the weights load"}.get(qprep, "K3_FUSE_DECODE_QPREP=0")}},
        "asked": {"qk_norm": asked[0], "decode_qprep": asked[1]},
        "probe": {"qprep_kernel": {"found": True, "clamps_positions": True,
                                   "source": "aiter"},
                  "dual_norm_op": {"found": True, "source": "aiter"}},
    }


def write(path: Path, obj: object, gz: bool) -> None:
    data = json.dumps(obj, separators=(",", ":")).encode()
    if gz:
        data = gzip.compress(data, mtime=0)
    path.write_bytes(data)


def fresh(name: str) -> Path:
    d = HERE / name
    if d.exists():
        shutil.rmtree(d)
    d.mkdir()
    return d


def trace_name(rank: int) -> str:
    return f"1764700000-rank-{rank}.1764700001.pt.trace.json.gz"


def write_set(name: str, world: int, mla: list[int], layers: int, steps: list[tuple[int, int]],
              norm: str, qprep: str, records: list[dict] | None, member: str = "per_head",
              ranks: list[int] | None = None, frontend: bool = False) -> Path:
    d = fresh(name)
    for rank in (range(world) if ranks is None else ranks):
        write(d / trace_name(rank), make_trace(rank, world, mla, layers, steps, norm, qprep,
                                               member), gz=True)
    if frontend:  # the front-end trace (no engine steps) that the census must ignore
        write(d / "1764700000.async_llm.1764700001.pt.trace.json.gz",
              {"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "AsyncLLM.generate",
                                "pid": 1, "tid": 1, "ts": 1.0, "dur": 2.0}]}, gz=True)
    for rec in records or []:
        write(d / f"k3rocm-decisions-pid{rec[-1]['pid']}.json", rec, gz=False)
    return d


def recs(world: int, qk: str, qprep: str, asked: tuple[bool, bool],
         construct_qprep: str | None = None, **kw) -> list[list[dict]]:
    """Per TP rank one process: a construct record, then the load record (the final one)."""
    out = []
    for r in range(world):
        pid = 5000 + r
        first = construct_qprep or ("needs-model" if qprep == "on" else qprep)
        out.append([record(pid, r, qk, first, asked, phase="construct"),
                    record(pid, r, qk, qprep, asked, **kw)])
    return out


def main() -> None:
    tiny = [0, 1, 2]  # tiny DeepSeek-V3: 3 layers, all MLA
    six = [(0, 8)] * 6
    on, off = (True, True), (False, False)
    # 2 ranks, 6 decode steps, both fusions on / off, with the overlay's records beside
    write_set("rocm-on", 2, tiny, 3, six, "on", "on", recs(2, "on", "on", on), frontend=True)
    write_set("rocm-off", 2, tiny, 3, six, "off", "off", recs(2, "off", "off", off),
              frontend=True)
    # the fused norm launched while the stock pair still runs
    write_set("rocm-fused-and-pair", 2, tiny, 3, six, "both", "on", recs(2, "on", "on", on))
    # the fused Q-prep's _general member (no position clamp) ran
    write_set("rocm-general", 2, tiny, 3, six, "on", "on", recs(2, "on", "on", on),
              member="general")
    # the _opt member: allowed
    write_set("rocm-opt", 1, tiny, 3, six, "on", "on", recs(1, "on", "on", on), member="opt")
    # asked on, the overlay reported decode Q-prep off after load (and ran stock)
    write_set("rocm-on-reported-off", 2, tiny, 3, six, "on", "off",
              recs(2, "on", "off", on, construct_qprep="on",
                   qprep_why="backend wants a bf16 query"))
    # 7 of 8 ranks
    write_set("rocm-7of8", 8, tiny, 3, [(0, 8)], "on", "on", recs(8, "on", "on", on),
              ranks=list(range(7)))
    # worker traces without distributedInfo and without a rank in the file name
    d = fresh("rocm-rankless")
    for i in range(2):
        write(d / f"worker-{'ab'[i]}.1764700001.pt.trace.json.gz",
              make_trace(None, None, tiny, 3, six, "on", "on"), gz=True)
    # a corrupt gzip stream (truncated) and a non-numeric ts
    d = fresh("rocm-corrupt-gzip")
    good = gzip.compress(json.dumps(make_trace(0, 1, tiny, 3, six, "on", "on")).encode(),
                         mtime=0)
    (d / trace_name(0)).write_bytes(good[: len(good) // 2])
    d = fresh("rocm-bad-ts")
    write(d / trace_name(0), make_trace(0, 1, tiny, 3, six, "on", "on", bad_ts=True), gz=True)
    # plain JSON, world size 1: a mixed (prefill + decode) step, a step without a forward,
    # then decode-only steps; fusions on
    d = fresh("rocm-mixed-plain")
    write(d / "dp0_pp0_tp0_dcp0_ep0_rank0.1764700002.pt.trace.json",
          make_trace(0, 1, tiny, 3, [(1, 7), (0, 0)] + [(0, 8)] * 4, "on", "on"), gz=False)
    # the upstream anchor's shape: Kimi-K3 (93 layers, 24 MLA = every 4th layer, 0-based
    # 3, 7, ..., 91, and the last layer 92; see models/kimi-k3/config.json), 6 decode steps
    # with MTP k=2 (3 tokens per request), 2 ranks
    cfg = json.loads((HERE / "models" / "kimi-k3" / "config.json").read_text())
    kda = set(cfg["text_config"]["linear_attn_config"]["kda_layers"])
    k3_mla = [i for i in range(93) if (i + 1) not in kda]
    assert len(k3_mla) == 24, k3_mla
    write_set("k3-anchor-on", 2, k3_mla, 93, six, "on", "on", recs(2, "on", "on", on))
    write_set("k3-anchor-off", 2, k3_mla, 93, six, "off", "off", recs(2, "off", "off", off))
    # server logs with K3ROCM-DECISION lines (vLLM's log prefix before the marker)
    d = fresh("records")
    lines = ["INFO 12-03 13:00:00 [api_server.py:1] vLLM API server version 0.26.1rc1"]
    for r in range(2):
        pid = 5000 + r
        # construct: Q-prep gates only decidable after load; load: on (target), draft off
        for rec in (record(pid, r, "on", "needs-model", on, phase="construct"),
                    record(pid, r, "on", "on", on),
                    record(pid, r, "on", "off", on, kind="draft",
                           qprep_why="draft layers: MTP block keeps the stock path")):
            lines.append(f"(VllmWorker TP{r} pid={pid}) INFO 12-03 13:00:0{r} [mla.py:88] "
                         f"K3ROCM-DECISION {json.dumps(rec, separators=(',', ':'))}")
    (d / "server-on.log").write_text("\n".join(lines) + "\n")
    (d / "server-qprep-off-after-load.log").write_text("\n".join(
        f"(VllmWorker TP{r} pid={5000 + r}) INFO [mla.py:88] K3ROCM-DECISION "
        + json.dumps(record(5000 + r, r, "on", state, on, phase=phase,
                            qprep_why="backend wants a bf16 query"), separators=(",", ":"))
        for r in range(2) for phase, state in (("construct", "on"), ("load", "off"))) + "\n")
    (d / "server-stock.log").write_text(lines[0] + "\n")  # the overlay never ran
    # the upstream hook's records (vLLM 0.32.0's own amd/mla.py): both on, both off, and a
    # base whose Q-prep attribute is not what the hook expects (state unknown; a made-up
    # future release)
    for name, qk, qprep, asked, vllm in (
            ("on", "on", "on", on, "0.32.0"), ("off", "off", "off", off, "0.32.0"),
            ("qprep-unknown", "on", "unknown", on, "0.35.0.dev7")):
        (d / f"server-upstream-{name}.log").write_text("\n".join(
            f"(EngineCore_DP0 pid={4000 + r}) (Worker_TP{r} pid={5000 + r}) INFO 12-05 "
            f"07:00:0{r} [decisions.py:221] K3ROCM-DECISION "
            + json.dumps(upstream_record(5000 + r, r, qk, qprep, asked, vllm=vllm),
                         sort_keys=True)
            for r in range(2)) + "\n")
    (d / "server-bad-json.log").write_text("INFO K3ROCM-DECISION {\"schema\": \n")


if __name__ == "__main__":
    main()
