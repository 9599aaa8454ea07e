"""The overlay wrapper inside REAL vLLM on CPU (run by test_overlay_standin.py in the stand-ins;
or ``pytest -o python_files='check_*.py' tests/overlay_invllm`` where vLLM imports). The overlay
runs unmodified; tests/doubles supply an ``aiter`` shaped like ROCm/aiter (torch reference
kernels) and ``rocm_vllm.activate()`` (this vLLM answers like ROCm + AITER).
(a) probe and load-time gates, (b) numerics of the fused paths against stock, (c) launches per
MLA layer and decode step.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
# vLLM's native fp8 quant op asks torch.compile for a fused CPU kernel, which needs a C++
# compiler the stand-in images lack; eager gives the same values.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DOUBLES = REPO / "tests" / "doubles"
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(DOUBLES))

import aiter  # noqa: E402 - the AITER double (clamp generation in this process)
import aiter_mla_routes  # noqa: E402 - vLLM's AITER MLA decode routing, two generations
import mla_cpu  # noqa: E402
import rocm_vllm  # noqa: E402
from aiter import _reference as ref  # noqa: E402

FP8 = torch.float8_e4m3fn
QPREP = "aiter::fuse_qk_rope_concat_and_cache_mla"  # device-kernel family (3 members)


def qprep_calls() -> int:
    return sum(v for k, v in aiter.calls.items() if k.startswith(QPREP))


@pytest.fixture(scope="module")
def vctx():
    with mla_cpu.vllm_cpu_context() as cfg:
        yield cfg


@pytest.fixture(scope="module")
def mla(vctx):
    return mla_cpu.load_overlay_module()


@pytest.fixture
def rocm(mla):
    """The overlay's probe (run once per process, as in a server) asks a vLLM that answers like
    ROCm + AITER."""
    undo = rocm_vllm.activate(platform=True)
    try:
        mla._probe(refresh=True)
    finally:
        undo()
    yield mla
    mla._probe(refresh=True)


def _overlay_applied() -> bool:
    from k3rocm.serving.overlay import status

    return status()["amd_mla"] == "k3rocm overlay"


# The CLI where vLLM's tree holds the overlay (0.27.1 here). The probe's vLLM-facing half runs
# in-process on every vLLM: test_constructs_on_this_vllm_and_reports_why_off, test_decision_records.
where_applied = pytest.mark.skipif(not _overlay_applied(),
                                   reason="the overlay is not applied in this vLLM")


def _probe_cli(env: dict) -> dict:
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("K3_", "PYTHONPATH"))}
    p = subprocess.run([sys.executable, "-m", "k3rocm", "overlay", "probe", "--json",
                        "--overlay-dir", str(REPO / "overlay")],
                       capture_output=True, text=True, env={**base, **env}, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)


# ------------------------------------------------------------------ (a) probe and gates


@where_applied
def test_probe_cli_on_cpu_without_aiter():
    rep = _probe_cli({})
    print("PROBE none " + json.dumps(rep, sort_keys=True))
    assert rep["qprep_kernel"]["found"] is False
    assert rep["dual_norm_op"]["found"] is False
    qk = rep["fusions"]["qk_norm"]
    assert qk["state"] == "off" and "AITER not enabled" in qk["reason"]
    assert rep["fusions"]["decode_qprep"]["reason"] == "platform is not ROCm"


@where_applied
@pytest.mark.parametrize("variant,newer_schema,qk_off", [
    ("clamp", True, True), ("preclamp", False, False)])  # grouped registers clamp's stub
def test_probe_cli_reads_the_registered_schema(variant, newer_schema, qk_off):
    """The production probe against both AITER schema generations reports the registered
    schema (one fresh process each: the probe runs once per process); K3_FUSE_QK_NORM=0 is
    read."""
    rep = _probe_cli({"PYTHONPATH": str(DOUBLES), "K3_TEST_DOUBLE_ROCM": "platform",
                      "K3_TEST_AITER_VARIANT": variant, **({"K3_FUSE_QK_NORM": "0"} if qk_off
                                                           else {})})
    print(f"PROBE {variant} " + json.dumps(rep, sort_keys=True))
    q = rep["qprep_kernel"]
    assert q["found"] is True and "clamps_positions" not in q
    assert q["source"] == ("torch.ops.aiter.fused_qk_rope_concat_and_cache_mla schema "
                           f"({'has' if newer_schema else 'no'} compute_all_q_rope)")
    assert ("compute_all_q_rope" in q["schema"]) is newer_schema
    assert rep["dual_norm_op"]["found"] is True
    assert rep["fusions"]["qk_norm"]["state"] == ("off" if qk_off else "needs-model")
    assert ("K3_FUSE_QK_NORM=0" in rep["fusions"]["qk_norm"]["reason"]) is qk_off
    assert rep["fusions"]["decode_qprep"]["state"] == "needs-model"
    assert "1-row cos/sin, all-zero positions" in rep["fusions"]["decode_qprep"]["reason"]


def test_constructs_on_this_vllm_and_reports_why_off(mla, vctx):
    import vllm
    from vllm.model_executor.layers.mla import MultiHeadLatentAttentionWrapper

    mla._probe(refresh=True)  # this process without the ROCm double
    w = mla_cpu.build_wrapper(mla.KimiK3MultiHeadLatentAttentionWrapper, heads=4)
    assert isinstance(w, MultiHeadLatentAttentionWrapper)
    print(f"vLLM {vllm.__version__}: qk_norm {w._use_eager_qk_rmsnorm_fusion} "
          f"({w._qk_rmsnorm_why}); qprep {w._fused_qk_prep} ({w._fused_qk_prep_why})")
    assert w._use_eager_qk_rmsnorm_fusion is False
    assert "AITER not enabled" in w._qk_rmsnorm_why
    assert w._fused_qk_prep is False and w._fused_qk_prep_why == "platform is not ROCm"


def _attn_patch(monkeypatch, **attrs):
    """Real MLAAttention, with attributes set right after its own __init__."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    orig = MLAAttention.__init__

    def init(self, *a, **k):
        orig(self, *a, **k)
        for name, value in attrs.items():
            setattr(self, name, value)

    monkeypatch.setattr(MLAAttention, "__init__", init)


def _loaded(w, fp8_query=True):
    """As after weight loading with an fp8-query backend (AITER MLA): first forward."""
    w.mla_attn.impl.supports_quant_query_input = fp8_query
    if w._load_gates_pending:
        w._check_load_gates(torch.bfloat16)
    return w._fused_qk_prep, w._fused_qk_prep_why


REAL_CASES = [
    ("baseline", {}, {}, None, True, "fused_qk_rope_concat_and_cache_mla"),
    ("bf16 cache", {"cache_dtype": "auto"}, {}, None, False, "not fp8"),
    ("rank 256", {"kv_lora_rank": 256}, {}, None, False, "kv_lora_rank 256"),
    ("rope 32", {"rope": 32}, {}, None, False, "rope dim 32"),
    ("2 heads/rank", {"heads": 2}, {}, None, False, "< 2048"),
    ("pcp", {}, {"use_pcp": True}, None, False, "prefill context parallel"),
    ("head padding", {}, {"q_pad_num_heads": 16}, None, False, "padding"),
    ("hisparse", {}, {"hisparse_cache": object()}, None, False, "HiSparse"),
    ("fp8 bmm W_UK", {}, {"is_aiter_triton_fp8_bmm_enabled": True}, None, False, "fp8 bmm"),
    ("fp4 before fp8", {}, {"is_aiter_triton_fp8_bmm_enabled": True,
                            "is_aiter_triton_fp4_bmm_enabled": True}, None, True, ""),
    ("dynamic kv scales", {}, {"calculate_kv_scales": True}, None, False,
     "calculate_kv_scales"),
    ("toggle off", {}, {}, ("K3_FUSE_DECODE_QPREP", "0"), False, "K3_FUSE_DECODE_QPREP=0"),
]


@pytest.mark.parametrize("name,build,attrs,env,expect,why", REAL_CASES,
                         ids=[c[0] for c in REAL_CASES])
def test_gate_matrix_real_vllm(name, build, attrs, env, expect, why, rocm, monkeypatch,
                               vctx):
    mla = rocm
    if attrs:
        _attn_patch(monkeypatch, **attrs)
    if env:
        monkeypatch.setenv(*env)
    w = mla_cpu.build_wrapper(mla.KimiK3MultiHeadLatentAttentionWrapper, load_weights=False,
                              **build)
    if w._fused_qk_prep and "is_aiter_triton_fp4_bmm_enabled" not in attrs:
        w.mla_attn.W_UK_T = torch.zeros(w.num_heads, 128, w.kv_lora_rank)
    ok, reason = _loaded(w)
    assert ok is expect, reason
    assert why in reason


def test_first_forward_facts_flip_the_decision(rocm, vctx):
    cls = rocm.KimiK3MultiHeadLatentAttentionWrapper
    w = mla_cpu.build_wrapper(cls)  # weights loaded: W_UK_T exists
    assert w._fused_qk_prep is True and w._load_gates_pending is True
    assert _loaded(w)[0] is True
    w = mla_cpu.build_wrapper(cls)
    ok, why = _loaded(w, fp8_query=False)  # AITER's small-head Gluon decode wants bf16
    assert not ok and "bf16 query" in why
    w = mla_cpu.build_wrapper(cls)
    w.mla_attn.impl.dcp_world_size = 2
    assert _loaded(w)[0] is False
    w = mla_cpu.build_wrapper(cls, load_weights=False)  # no W_UK_T
    ok, why = _loaded(w)
    assert not ok and "W_UK_T" in why
    w = mla_cpu.build_wrapper(cls)
    w.mla_attn.impl.dcp_world_size = -1  # not known yet: resolved from the DCP group (1)
    assert _loaded(w)[0] is True


def test_decision_records(rocm, monkeypatch, tmp_path, vctx):
    """One machine-readable record per decision: in the log and beside the traces."""
    monkeypatch.setenv("K3_PROFILER_DIR", str(tmp_path))
    monkeypatch.setenv("K3_FUSE_QK_NORM", "0")  # a decision no other test made
    w = mla_cpu.build_wrapper(rocm.KimiK3MultiHeadLatentAttentionWrapper)
    _loaded(w)
    files = list(tmp_path.glob("k3rocm-decisions-pid*.json"))
    assert len(files) == 1
    recs = [r for r in json.loads(files[0].read_text())
            if r["fusions"]["qk_norm"]["reason"] == "K3_FUSE_QK_NORM=0"]
    assert [r["phase"] for r in recs] == ["construct", "load"]
    assert recs[0]["fusions"]["decode_qprep"]["state"] == "needs-model"
    from k3rocm.serving.decisions import final_in_log, parse_line

    log = "\n".join("INFO " + rocm.DECISION_MARKER + json.dumps(r) for r in recs)
    final = final_in_log(log)[(os.getpid(), "target")]
    assert final["fusions"] == {
        "qk_norm": {"state": "off", "reason": "K3_FUSE_QK_NORM=0"},
        "decode_qprep": {"state": "on", "reason": final["fusions"]["decode_qprep"]["reason"]}}
    assert final["asked"] == {"qk_norm": False, "decode_qprep": True}
    assert final["probe"]["qprep_kernel"] == {
        "found": True, "source": "torch.ops.aiter.fused_qk_rope_concat_and_cache_mla schema "
                                 "(has compute_all_q_rope)"}
    line = rocm.DECISION_MARKER + json.dumps(final)
    assert parse_line("(EngineCore pid=1) INFO x " + line) == final


# ------------------------------------------------------------------ (b) numerics


def _run_layer(cls, *, seed, scales, slots, positions, n_actual, prefills=0, hs_seed=7,
               q_len=1, profile=False, heads=4, routes=None):
    """One forward of a real wrapper on a decode batch; returns what matters."""
    w = mla_cpu.build_wrapper(cls, heads=heads, seed=seed)
    a = w.mla_attn
    a.impl.supports_quant_query_input = True  # as the AITER MLA backend, fp8 cache
    a._k_scale.fill_(scales[0])
    a._q_scale.fill_(scales[1])
    if hasattr(a, "_k_scale_float"):
        a._k_scale_float = scales[0]
    kv = torch.zeros(8, 16, 576, dtype=torch.uint8)
    a.kv_cache = kv
    rec: dict = {}

    def forward_mqa(q, kv_cache, attn_metadata, layer):
        with torch.profiler.record_function("test::forward_mqa (AITER MLA decode)"):
            rec["mqa_q"] = q.clone()
            assert kv_cache.dtype == FP8
            return q[..., :512].to(torch.bfloat16).contiguous(), None

    def forward_mha(q, kv_c_normed, k_pe, kv_c_and_k_pe_cache, attn_metadata, k_scale,
                    output, **kw):
        rec["mha_rows"] = q.shape[0]
        output.zero_()

    def do_kv_cache_update(kv_c, k_pe, cache, slot_mapping, dtype, scale):
        # one launch on ROCm: vllm::concat_and_cache_mla_kernel
        with torch.profiler.record_function("stock::concat_and_cache_mla"):
            ref.concat_and_cache_mla_ref(kv_c, k_pe, cache.view(FP8), slot_mapping, scale)

    quant_op = getattr(a, "_decode_concat_quant_fp8_op", None)
    if quant_op is not None:  # one Inductor kernel on ROCm (see the census kernel table)
        inner = quant_op.forward

        def concat_quant(*args, **kwargs):
            with torch.profiler.record_function("stock::decode_concat_quant_fp8"):
                return inner(*args, **kwargs)

        quant_op.forward = concat_quant

    if routes is None:
        a.impl.forward_mqa = forward_mqa
    else:  # the AITER MLA backend's real routing, of vLLM generation `routes`
        a.impl.__class__ = aiter_mla_routes.impl_class(type(a.impl), routes)
    a.impl.forward_mha = forward_mha
    a.impl.do_kv_cache_update = do_kv_cache_update
    t = slots.shape[0]
    md = mla_cpu.decode_metadata(t, n_actual, slots, prefills=prefills, q_len=q_len)
    hs = torch.randn(t, 256, generator=torch.Generator().manual_seed(hs_seed)).to(
        torch.bfloat16)
    with mla_cpu.forward_context(w, md, slots, t), torch.inference_mode():  # as vLLM runs
        if getattr(w, "_load_gates_pending", False):
            w._check_load_gates(hs.dtype)  # what the first forward (vLLM's profile run) does first
        if profile:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
                out = w(positions, hs)
            rec["ops"] = p.events()
        else:
            out = w(positions, hs)
    return {"out": out, "kv": kv.clone(), **rec}


def _fp8_steps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Max distance in fp8 code points (same-sign e4m3fn codes are ordered)."""
    ai = a.view(torch.uint8).to(torch.int16)
    bi = b.view(torch.uint8).to(torch.int16)

    def ordinal(x):
        mag = x & 0x7F
        return torch.where(x & 0x80 != 0, -mag, mag)

    return int((ordinal(ai) - ordinal(bi)).abs().max().item())


FUSION_CASES = [((1.0, 1.0), "clamp", 1), ((0.37, 0.61), "clamp", 1), ((2.5, 0.125), "clamp", 1),
                ((1.0, 1.0), "preclamp", 1), ((1.0, 1.0), "grouped", 1), ((1.0, 1.0), "grouped", 2)]


@pytest.mark.parametrize("scales,variant,heads_per_block", FUSION_CASES,
                         ids=["clamp", "clamp-scales-0.37-0.61", "clamp-scales-2.5-0.125",
                              "preclamp", "grouped-1-head", "grouped-2-heads"])
def test_decode_fusion_matches_stock(scales, variant, heads_per_block, rocm, monkeypatch, vctx):
    """Real positions far past the one-row identity cos/sin cache, under a schema that has
    compute_all_q_rope (which does not mean the kernel clamps): on every AITER variant, one
    that does not clamp included (v0.1.26's head-grouped one: cos = sin = 0 past the row,
    zeroing q_pe and the cached k_pe; or a fault), the fused path gives the stock path's query,
    cache and output, because the overlay hands the kernel all-zero positions."""
    from vllm.model_executor.layers.mla import MultiHeadLatentAttentionWrapper as Stock

    assert "compute_all_q_rope" in str(
        torch.ops.aiter.fused_qk_rope_concat_and_cache_mla.default._schema)
    monkeypatch.setattr(aiter, "VARIANT", variant)
    monkeypatch.setattr(aiter, "GROUPED_HEADS_PER_BLOCK", heads_per_block)
    g = torch.Generator().manual_seed(int(scales[0] * 100))
    n, t = 5, 8  # 3 padded rows (slot -1), as with CUDA-graph padding
    slots = torch.cat([torch.randperm(128, generator=g)[:n], torch.full((t - n,), -1)])
    positions = torch.cat([torch.tensor([0, 7, 4095, 2**20 - 1, 2**20 + 5]),
                           torch.zeros(t - n, dtype=torch.long)])
    before = collections.Counter(aiter.calls)
    fused = _run_layer(rocm.KimiK3MultiHeadLatentAttentionWrapper, seed=3, scales=scales,
                       slots=slots, positions=positions, n_actual=n)
    assert qprep_calls() == sum(v for k, v in before.items() if k.startswith(QPREP)) + 1
    assert aiter.calls["aiter::fused_qk_rmsnorm_kernel"] == before[
        "aiter::fused_qk_rmsnorm_kernel"] + 1
    stock = _run_layer(Stock, seed=3, scales=scales, slots=slots, positions=positions,
                       n_actual=n)
    # Query fed to the decode kernel: both paths compute x * (1/q_scale) -> fp8 from the
    # same bf16 ql_nope / q_pe (identity RoPE is exact): bit-exact (up to the sign of 0).
    assert stock["mqa_q"].shape == fused["mqa_q"].shape == (n, 4, 576)
    assert torch.equal(stock["mqa_q"].float(), fused["mqa_q"].float())
    # KV cache: vLLM's write divides by k_scale, AITER's kernel multiplies by 1/k_scale:
    # equal bytes almost everywhere, never more than one fp8 step apart.
    ks, kf = stock["kv"].view(FP8), fused["kv"].view(FP8)
    assert torch.equal(stock["kv"] != 0, fused["kv"] != 0)  # same rows written
    assert _fp8_steps(ks, kf) <= 1
    if scales[0] in (1.0, 2.5):  # power-of-two scales: both orders round identically
        assert torch.equal(stock["kv"], fused["kv"])
    written = (fused["kv"].view(-1, 576) != 0).any(-1).nonzero().flatten()
    assert sorted(written.tolist()) == sorted(slots[:n].tolist())
    k_pe = fused["kv"].view(-1, 576)[slots[:n], 512:]
    assert bool((k_pe != 0).any(-1).all())  # every written row has its k_pe
    # And the layer output of the real rows is identical.
    assert torch.equal(stock["out"][:n], fused["out"][:n])


# Ops that launch no kernel: views and allocations.
_NO_LAUNCH = {"aten::view", "aten::transpose", "aten::split", "aten::split_with_sizes",
              "aten::slice", "aten::select", "aten::unsqueeze", "aten::squeeze",
              "aten::as_strided", "aten::empty", "aten::empty_strided", "aten::t",
              "aten::reshape", "aten::_reshape_alias", "aten::detach", "aten::alias",
              "aten::expand", "aten::permute", "aten::narrow", "aten::resize_",
              "aten::lift_fresh", "aten::contiguous", "aten::chunk", "aten::unbind",
              "aten::result_type", "aten::to", "aten::flatten", "aten::new_empty",
              "aten::empty_like"}
# vLLM's attention custom op only dispatches (forward_impl runs inside it): look through it.
_TRANSPARENT = {"vllm::unified_mla_attention_with_output", "vllm::unified_mla_attention"}
_COPIES = {"aten::copy_", "aten::clone", "aten::_to_copy"}


def _launches(events) -> tuple[collections.Counter, list[str]]:
    """Ops that launch work (outermost, looking through vLLM's attention dispatch op), and
    every copy that is not internal to another op (a kernel of its own on the GPU)."""
    top: collections.Counter = collections.Counter()
    copies = []
    for e in events:
        chain, parent = [], e.cpu_parent
        while parent is not None:
            chain.append(parent.name)
            parent = parent.cpu_parent
        opaque = [c for c in chain if c not in _TRANSPARENT]
        if e.name in _COPIES and all(c.startswith("aten::") and c not in (
                "aten::linear", "aten::matmul") for c in opaque):
            copies.append(" < ".join([e.name, *chain]))
        if not opaque and e.name not in _NO_LAUNCH | _TRANSPARENT:
            top[e.name] += 1
    return top, copies


@pytest.mark.parametrize("q_len", [1, 3], ids=["1-token", "3-tokens-mtp2"])
def test_ops_per_mla_layer_per_decode_step(q_len, rocm, monkeypatch, vctx):
    """Stock: W_UK bmm, concat + fp8 quant, cache write. Fused: W_UK bmm, one Q-prep launch,
    and no copy kernel (the bmm writes the dense (B, N, L) layout the kernel reads)."""
    from vllm.model_executor.layers.mla import MultiHeadLatentAttentionWrapper as Stock

    monkeypatch.setenv("K3_FUSE_QK_NORM", "0")  # same norms on both sides: Q-prep only
    reqs = 4
    t = reqs * q_len
    slots = torch.arange(t) * 3
    positions = torch.arange(t) + 100
    runs = {}
    for name, cls in (("stock", Stock), ("fused", rocm.KimiK3MultiHeadLatentAttentionWrapper)):
        res = _run_layer(cls, seed=5, scales=(1.0, 1.0), slots=slots, positions=positions,
                         n_actual=t, q_len=q_len, profile=True)
        runs[name] = _launches(res["ops"])
    (stock, stock_copies), (fused, fused_copies) = runs["stock"], runs["fused"]
    names = sorted(set(stock) | set(fused))
    print(f"OPS q_len={q_len} tokens={t}: " + json.dumps(
        {n: [stock.get(n, 0), fused.get(n, 0)] for n in names}))
    print(f"OPS q_len={q_len} copies stock={stock_copies} fused={fused_copies}")
    assert stock["vllm::unified_mla_kv_cache_update"] == 1  # stock::concat_and_cache_mla
    assert stock["stock::decode_concat_quant_fp8"] == 1
    assert fused["aiter::fused_qk_rope_concat_and_cache_mla"] == 1
    assert fused["vllm::unified_mla_kv_cache_update"] == 0
    assert fused["stock::decode_concat_quant_fp8"] == 0
    # No copy of the fused path's own. A copy inside aten::bmm is the CPU backend's: on a CPU
    # with AVX512-BF16/AMX torch routes the bf16 bmm to oneDNN, which makes its strided
    # operands contiguous first (seen on an AMD EPYC with avx512_bf16; none on AVX2 machines).
    # The W_UK bmm is the same call in both paths, so those copies must match one for one.
    def in_bmm(c: str) -> bool:
        return "aten::bmm" in c.split(" < ")[1:]

    assert [c for c in fused_copies if not in_bmm(c)] == [], fused_copies
    assert sum(map(in_bmm, fused_copies)) == sum(map(in_bmm, stock_copies)), (
        fused_copies, stock_copies)
    # the two stock launches became one; nothing else was added
    assert sum(fused.values()) == sum(stock.values()) - 1


def test_mixed_prefill_decode_falls_through(rocm, vctx):
    cls = rocm.KimiK3MultiHeadLatentAttentionWrapper
    slots = torch.tensor([5, 9, 33, -1])
    positions = torch.tensor([3, 4, 0, 0])
    before = qprep_calls()
    res = _run_layer(cls, seed=4, scales=(1.0, 1.0), slots=slots, positions=positions,
                     n_actual=3, prefills=1)
    assert qprep_calls() == before
    assert res["mha_rows"] == 1 and res["mqa_q"].shape[0] == 2  # the stock split


def test_profile_run_without_metadata_falls_through(rocm, vctx):
    cls = rocm.KimiK3MultiHeadLatentAttentionWrapper
    w = mla_cpu.build_wrapper(cls, heads=4)
    _loaded(w)
    before = qprep_calls()
    out = mla_cpu.profile_forward(w, torch.randn(2, 256).to(torch.bfloat16))
    assert out.shape == (2, 256)
    assert qprep_calls() == before  # the stock path ran


def test_dual_rmsnorm_reference_matches_vllm_rmsnorm(vctx):
    from vllm.model_executor.layers.layernorm import RMSNorm

    rocm_vllm.register_dual_norm_op()
    g = torch.Generator().manual_seed(11)
    n1, n2 = RMSNorm(128, eps=1e-6), RMSNorm(512, eps=1e-5)
    with torch.no_grad():
        n1.weight.copy_(1 + 0.1 * torch.randn(128, generator=g))
        n2.weight.copy_(1 + 0.1 * torch.randn(512, generator=g))
    n1, n2 = n1.to(torch.bfloat16), n2.to(torch.bfloat16)
    x = torch.randn(9, 128 + 512 + 64, generator=g).to(torch.bfloat16)
    q, kv = x[:, :128], x[:, 128:640]  # strided views, as in the wrapper
    y1, y2 = torch.ops.vllm.fused_mla_dual_rms_norm(q, n1.weight, kv, n2.weight, 1e-6, 1e-5)
    assert torch.equal(y1, n1(q)) and torch.equal(y2, n2(kv))


def _qprep_inputs(seed: int, t: int, h: int) -> list[torch.Tensor]:
    """q_nope, q_pe, kv_c, k_pe (bf16) for ``t`` tokens and ``h`` heads."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g).to(torch.bfloat16)
            for shape in ((t, h, 512), (t, h, 64), (t, 512), (t, 64))]


def test_reference_kernel_contract():
    t, h = 4, 4  # 512 x 4 = 2048: the clamping _opt kernel (2 heads: general)
    q_nope, q_pe, kv_c, k_pe = _qprep_inputs(2, t, h)
    cache = torch.zeros(2, 4, 576, dtype=torch.uint8)
    q_out = torch.full((t, h, 576), 7, dtype=torch.uint8)
    slots = torch.tensor([1, -1, 6, 2])
    one = torch.tensor(1.0)
    # Two-row cache whose row 1 is a real rotation: positions clamp to row 1.
    cos = torch.stack([torch.ones(32), torch.zeros(32)]).to(torch.bfloat16)
    sin = torch.stack([torch.zeros(32), torch.ones(32)]).to(torch.bfloat16)
    with pytest.raises(TypeError):
        ref.fused_qk_rope_concat_and_cache_mla(q_nope, q_pe, kv_c, k_pe, cache,
                                               q_out.view(FP8), slots, one, one,
                                               torch.zeros(t), cos, sin, True, True)
    ref.fused_qk_rope_concat_and_cache_mla(
        q_nope, q_pe, kv_c, k_pe, cache.view(FP8), q_out.view(FP8), slots, one, one,
        torch.tensor([0, 0, 99, 1]), cos, sin, is_neox=True, is_nope_first=True)
    assert torch.equal(q_out[1], torch.full((h, 576), 7, dtype=torch.uint8))  # slot < 0
    qo = q_out.view(FP8).float()
    assert torch.equal(qo[0, :, 576 - 64:], q_pe[0].to(FP8).float())  # row 0: identity
    x1, x2 = q_pe[2].float().chunk(2, -1)  # position 99 clamped to row 1: rotate by 90
    assert torch.equal(qo[2, :, 512:], torch.cat((-x2, x1), -1).to(FP8).float())
    assert torch.equal(cache.view(FP8)[0, 1].float(),
                       torch.cat((kv_c[0], k_pe[0])).to(FP8).float())
    assert int((cache.view(-1, 576) != 0).any(-1).sum()) == 3


@pytest.mark.parametrize("variant", ["clamp", "preclamp", "grouped"])
def test_reference_kernel_past_a_one_row_cache(variant, monkeypatch):
    """What the double's variants do with a position past a one-row identity cache, and that
    position 0 is exact on all of them (the overlay's zero positions)."""
    monkeypatch.setattr(aiter, "VARIANT", variant)
    t, h = 2, 4
    q_nope, q_pe, kv_c, k_pe = _qprep_inputs(3, t, h)
    cos, sin = torch.ones(1, 32, dtype=torch.bfloat16), torch.zeros(1, 32, dtype=torch.bfloat16)
    one = torch.tensor(1.0)

    def run(positions):
        cache = torch.zeros(2, 4, 576, dtype=torch.uint8)
        q_out = torch.zeros(t, h, 576, dtype=torch.uint8)
        ref.fused_qk_rope_concat_and_cache_mla(
            q_nope, q_pe, kv_c, k_pe, cache.view(FP8), q_out.view(FP8), torch.tensor([1, 6]),
            one, one, positions, cos, sin, is_neox=True, is_nope_first=True)
        return q_out.view(FP8).float(), cache.view(FP8).view(-1, 576).float()

    q0, c0 = run(torch.zeros(t, dtype=torch.long))  # zero positions: identity everywhere
    assert torch.equal(q0[:, :, 512:], q_pe.to(FP8).float())
    assert torch.equal(c0[6, 512:], k_pe[1].to(FP8).float())
    if variant == "preclamp":
        with pytest.raises(IndexError, match="does not clamp"):
            run(torch.tensor([0, 5]))
        return
    q5, c5 = run(torch.tensor([0, 5]))
    if variant == "clamp":
        assert torch.equal(q5, q0) and torch.equal(c5, c0)
    else:  # head-grouped, one head per block: cos = sin = 0 past the row
        assert torch.equal(q5[1, :, 512:], torch.zeros(h, 64))
        assert torch.equal(c5[6, 512:], torch.zeros(64)) and torch.equal(c5[1], c0[1])
        monkeypatch.setattr(aiter, "GROUPED_HEADS_PER_BLOCK", 2)
        with pytest.raises(IndexError):
            run(torch.tensor([0, 5]))


# ------------------------------------------------------------ (e) the backend's real routes


def _decode12(cls, routes, q_len=1, profile=False):
    reqs = 4
    t = reqs * q_len
    return _run_layer(cls, seed=6, scales=(1.0, 1.0), slots=torch.arange(t) * 5,
                      positions=torch.arange(t) + 50, n_actual=t, q_len=q_len, heads=12,
                      profile=profile, routes=routes)


def test_gluon_route_refuses_qprep_at_12_heads_on_the_nightly_era_backend(rocm, vctx):
    """vLLM 0.27.1 sends a 12-head decode to AITER's Gluon kernel, which takes a bf16 query: the
    fused path (fp8 q_out) must not run there."""
    cls = rocm.KimiK3MultiHeadLatentAttentionWrapper
    before = qprep_calls()
    with pytest.raises(AssertionError, match="must be bf16"):
        _decode12(cls, "0.27.1")  # fused path refused -> stock -> fp8 query into Gluon
    assert qprep_calls() == before
    assert aiter_mla_routes.ROUTES[-1] == {"route": "gluon", "q": FP8, "heads": 12}
    w = mla_cpu.build_wrapper(cls, heads=12)
    w.mla_attn.impl.__class__ = aiter_mla_routes.impl_class(type(w.mla_attn.impl), "0.27.1")
    ok, why = _loaded(w)
    assert not ok and "Gluon" in why, why


@pytest.mark.parametrize("q_len", [1, 3], ids=["1-token", "3-tokens-mtp2"])
def test_launches_at_12_heads_on_the_padded_asm_route(q_len, rocm, monkeypatch, vctx):
    """vLLM 0.33's fp8 route at 12 heads: padded asm decode (16 heads)."""
    from vllm.model_executor.layers.mla import MultiHeadLatentAttentionWrapper as Stock

    monkeypatch.setenv("K3_FUSE_QK_NORM", "0")
    runs, copied = {}, {}
    for name, cls in (("stock", Stock), ("fused", rocm.KimiK3MultiHeadLatentAttentionWrapper)):
        before = qprep_calls()
        res = _decode12(cls, "0.33", q_len=q_len, profile=True)
        assert (qprep_calls() - before) == (1 if name == "fused" else 0)
        runs[name] = _launches(res["ops"])[0]
        route = aiter_mla_routes.ROUTES[-1]
        assert route["route"] == "asm" and route["q"] == FP8, route
        copied[name] = route["copied"]
    stock, fused = runs["stock"], runs["fused"]
    names = sorted(set(stock) | set(fused))
    print(f"OPS12 q_len={q_len}: " + json.dumps(
        {n: [stock.get(n, 0), fused.get(n, 0)] for n in names}))
    assert copied == {"stock": True, "fused": False}
    pad = {"aten::repeat", "aten::contiguous", "aten::clone", "aten::copy_"}
    assert sum(stock[n] for n in pad if n in stock) >= 1  # the backend's padding copy
    assert not any(n in fused for n in ("aten::repeat", "aten::clone", "aten::copy_"))
    # concat+quant and the cache write became one launch, and the padding copies are gone
    assert sum(fused.values()) < sum(stock.values()) - 1
