"""Overlay wrapper inside REAL vLLM (run by tests/test_overlay_standin.py in the stand-in
images, or directly in a venv with vLLM: ``pytest -o python_files='check_*.py'
tests/overlay_invllm``). Needs vLLM importable; CPU only.

(a) construction on this vLLM + the gate matrix (each gate alone flips the decision);
(b) numerics of both fused paths against the stock path, with the torch reference
    kernels (k3rocm.testing.reference_ops) standing in for AITER's;
wiring: vLLM's own plugin loader makes the AMD Kimi-K3 attention build our wrapper.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
# vLLM's native fp8 quant op asks torch.compile for a fused CPU kernel, which needs a C++
# compiler the stand-in images lack; eager gives the same values.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))

from k3rocm.testing import mla_cpu  # noqa: E402
from k3rocm.testing import reference_ops as ref  # noqa: E402

FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def vctx():
    with mla_cpu.vllm_cpu_context() as cfg:
        yield cfg


@pytest.fixture(scope="module")
def mla(vctx):
    return mla_cpu.load_overlay_module()


@pytest.fixture
def test_mode(monkeypatch, mla):
    """Reference kernels + ROCm/AITER facts assumed (K3_TEST_REFERENCE_OPS=1)."""
    monkeypatch.setenv("K3_TEST_REFERENCE_OPS", "1")
    mla.probe_capabilities(refresh=True)
    yield mla
    monkeypatch.delenv("K3_TEST_REFERENCE_OPS")
    mla.probe_capabilities(refresh=True)


@pytest.fixture
def real_caps(monkeypatch, mla):
    monkeypatch.delenv("K3_TEST_REFERENCE_OPS", raising=False)
    mla.probe_capabilities(refresh=True)
    return mla


def _vllm_version() -> str:
    import vllm

    return vllm.__version__


# ------------------------------------------------------------------ (a) construction


def test_constructs_on_this_vllm_and_reports_why_off(real_caps, vctx):
    mla = real_caps
    from vllm.model_executor.layers.mla import MultiHeadLatentAttentionWrapper

    w = mla_cpu.build_wrapper(mla.KimiK3MultiHeadLatentAttentionWrapper, heads=4)
    assert isinstance(w, MultiHeadLatentAttentionWrapper)
    st = w.k3_status()
    print(f"vLLM {_vllm_version()}: {st}")
    # On CPU there is no ROCm/AITER: both off, each with its reason.
    assert st["qk_norm"] is False
    assert st["decode_qprep"] is False
    assert st["decode_qprep_reason"] == "platform is not ROCm"
    caps = mla.probe_capabilities()
    assert caps.aiter_enabled is False and caps.is_rocm is False  # None normalized


def test_probe_on_rocm_facts_without_aiter_kernels(monkeypatch, real_caps):
    """ROCm + AITER enabled but an AITER without the kernels: both fusions off."""
    mla = real_caps
    from vllm._aiter_ops import rocm_aiter_ops
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "is_rocm", lambda *a: True)
    monkeypatch.setattr(rocm_aiter_ops, "is_enabled", classmethod(lambda cls: True))
    monkeypatch.setattr(rocm_aiter_ops, "is_mla_enabled", classmethod(lambda cls: True))
    caps = mla.probe_capabilities(refresh=True)
    assert caps.is_rocm and caps.aiter_enabled and caps.aiter_mla_enabled
    assert caps.qprep_kernel is None and caps.qprep_source == "missing"
    ok, why = mla.decide_qk_norm(mla.NormFacts(True, caps.aiter_enabled, caps.dual_norm_op,
                                               True, True))
    assert not ok and "not registered" in why


FLIPS = [
    ({"toggle": False}, "K3_FUSE_DECODE_QPREP=0"),
    ({"is_rocm": False}, "not ROCm"),
    ({"aiter_mla_enabled": False}, "AITER MLA not enabled"),
    ({"kernel_present": False}, "not found"),
    ({"kernel_clamps": False}, "position clamp"),
    ({"kv_cache_dtype": "auto"}, "not fp8"),
    ({"kv_cache_dtype": "fp8_ds_mla"}, "not fp8"),
    ({"kv_lora_rank": 256}, "kv_lora_rank 256"),
    ({"rope_dim": 32}, "rope dim 32"),
    ({"heads": 2}, "< 2048"),
    ({"dcp_world_size": 2}, "decode context parallel"),
    ({"dcp_q_replicate": True}, "decode context parallel"),
    ({"use_pcp": True}, "prefill context parallel"),
    ({"hisparse": True}, "HiSparse"),
    ({"q_pad_num_heads": 16}, "padding"),
    ({"fp8_bmm": True}, "fp8 bmm"),
    ({"has_w_uk_t": False}, "W_UK_T missing"),
    ({"supports_fp8_query": False}, "bf16 query"),
    ({"has_rotary": True}, "rotary"),
    ({"calculate_kv_scales": True}, "calculate_kv_scales"),
    ({"sparse_or_indexer": True}, "sparse"),
]


def test_gate_matrix_pure(mla):
    base = mla.QPrepFacts(heads=12)  # Kimi-K3 at TP=8
    assert mla.decide_decode_qprep(base)[0] is True
    for flip, why in FLIPS:
        ok, reason = mla.decide_decode_qprep(mla.QPrepFacts(**{**base.__dict__, **flip}))
        assert ok is False, flip
        assert why in reason, (flip, reason)
    # fp4 bmm is checked before fp8 bmm (both may be set), as MLAAttention does.
    assert mla.decide_decode_qprep(mla.QPrepFacts(fp4_bmm=True, fp8_bmm=True))[0] is True
    assert mla.decide_decode_qprep(mla.QPrepFacts(fp4_bmm=True, has_w_uk_t=False))[0] is True
    assert mla.decide_decode_qprep(mla.QPrepFacts(heads=4))[0] is True  # 512 x 4 = 2048
    assert mla.decide_qk_norm(mla.NormFacts(True, True, True, True, True))[0] is True
    for i, why in enumerate(["K3_FUSE_QK_NORM=0", "AITER not enabled", "not registered",
                             "no q_lora_rank", "plain"]):
        args = [True] * 5
        args[i] = False
        ok, reason = mla.decide_qk_norm(mla.NormFacts(*args))
        assert not ok and why in reason


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
    w._k3_finalize()
    return w.k3_status()


REAL_CASES = [
    ("baseline", {}, {}, None, True),
    ("bf16 cache", {"cache_dtype": "auto"}, {}, None, False),
    ("rank 256", {"kv_lora_rank": 256}, {}, None, False),
    ("rope 32", {"rope": 32}, {}, None, False),
    ("2 heads/rank", {"heads": 2}, {}, None, False),
    ("pcp", {}, {"use_pcp": True}, None, False),
    ("head padding", {}, {"q_pad_num_heads": 16}, None, False),
    ("hisparse", {}, {"hisparse_cache": object()}, None, False),
    ("fp8 bmm W_UK", {}, {"is_aiter_triton_fp8_bmm_enabled": True}, None, False),
    ("fp4 before fp8", {}, {"is_aiter_triton_fp8_bmm_enabled": True,
                            "is_aiter_triton_fp4_bmm_enabled": True}, None, True),
    ("dynamic kv scales", {}, {"calculate_kv_scales": True}, None, False),
    ("toggle off", {}, {}, ("K3_FUSE_DECODE_QPREP", "0"), False),
]


@pytest.mark.parametrize("name,build,attrs,env,expect", REAL_CASES,
                         ids=[c[0] for c in REAL_CASES])
def test_gate_matrix_real_vllm(name, build, attrs, env, expect, test_mode, monkeypatch,
                               vctx):
    mla = test_mode
    if attrs:
        _attn_patch(monkeypatch, **attrs)
    if env:
        monkeypatch.setenv(*env)
    w = mla_cpu.build_wrapper(mla.KimiK3MultiHeadLatentAttentionWrapper, load_weights=False,
                              **build)
    # W_UK_T exists after weight loading (read at first forward); fp4 does not need it
    if w._k3_qprep and "is_aiter_triton_fp4_bmm_enabled" not in attrs:
        w.mla_attn.W_UK_T = torch.zeros(w.num_heads, 128, w.kv_lora_rank)
    st = _loaded(w)
    assert st["decode_qprep"] is expect, st


def test_first_forward_facts_flip_the_decision(test_mode, vctx):
    mla = test_mode
    cls = mla.KimiK3MultiHeadLatentAttentionWrapper
    w = mla_cpu.build_wrapper(cls)  # weights loaded: W_UK_T exists
    assert _loaded(w)["decode_qprep"] is True
    w = mla_cpu.build_wrapper(cls)
    assert _loaded(w, fp8_query=False)["decode_qprep"] is False  # small-head Gluon decode
    w = mla_cpu.build_wrapper(cls)
    w.mla_attn.impl.dcp_world_size = 2
    assert _loaded(w)["decode_qprep"] is False
    w = mla_cpu.build_wrapper(cls, load_weights=False)  # no W_UK_T
    assert _loaded(w)["decode_qprep"] is False
    w = mla_cpu.build_wrapper(cls)
    w.mla_attn.impl.dcp_world_size = -1  # not known yet: resolved from the DCP group (1)
    assert _loaded(w)["decode_qprep"] is True


def test_norm_toggle_and_old_aiter(test_mode, monkeypatch, vctx):
    mla = test_mode
    cls = mla.KimiK3MultiHeadLatentAttentionWrapper
    assert mla_cpu.build_wrapper(cls, load_weights=False).k3_status()["qk_norm"] is True
    monkeypatch.setenv("K3_FUSE_QK_NORM", "0")
    assert mla_cpu.build_wrapper(cls, load_weights=False).k3_status()["qk_norm"] is False
    monkeypatch.delenv("K3_FUSE_QK_NORM")
    mla.probe_capabilities().qprep_clamps = False  # AITER before ROCm/aiter#4342
    w = mla_cpu.build_wrapper(cls, load_weights=False)
    assert w.k3_status()["decode_qprep"] is False and "clamp" in w._k3_qprep_why


# ------------------------------------------------------------------ (b) numerics


def _run_layer(cls, *, seed, scales, slots, positions, n_actual, prefills=0, hs_seed=7):
    """One forward of a real wrapper on a decode batch; returns what matters."""
    w = mla_cpu.build_wrapper(cls, heads=4, seed=seed)
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
        rec["mqa_q"] = q.clone()
        assert kv_cache.dtype == FP8
        return q[..., :512].to(torch.bfloat16).contiguous(), None

    def forward_mha(q, kv_c_normed, k_pe, kv_c_and_k_pe_cache, attn_metadata, k_scale,
                    output, **kw):
        rec["mha_rows"] = q.shape[0]
        output.zero_()

    def do_kv_cache_update(kv_c, k_pe, cache, slot_mapping, dtype, scale):
        ref.concat_and_cache_mla_ref(kv_c, k_pe, cache.view(FP8), slot_mapping, scale)

    a.impl.forward_mqa = forward_mqa
    a.impl.forward_mha = forward_mha
    a.impl.do_kv_cache_update = do_kv_cache_update
    t = slots.shape[0]
    md = mla_cpu.decode_metadata(t, n_actual, slots, prefills=prefills)
    hs = torch.randn(t, 256, generator=torch.Generator().manual_seed(hs_seed)).to(
        torch.bfloat16)
    with mla_cpu.forward_context(w, md, slots, t):
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


@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.37, 0.61), (2.5, 0.125)])
def test_decode_fusion_matches_stock(scales, test_mode, vctx):
    from vllm.model_executor.layers.mla import MultiHeadLatentAttentionWrapper as Stock

    mla = test_mode
    cls = mla.KimiK3MultiHeadLatentAttentionWrapper
    g = torch.Generator().manual_seed(int(scales[0] * 100))
    n, t = 5, 8  # 3 padded rows (slot -1), as with CUDA-graph padding
    slots = torch.cat([torch.randperm(128, generator=g)[:n], torch.full((t - n,), -1)])
    positions = torch.cat([torch.tensor([0, 7, 4095, 2**20 - 1, 2**20 + 5]),
                           torch.zeros(t - n, dtype=torch.long)])
    before = dict(cls.counters)
    fused = _run_layer(cls, seed=3, scales=scales, slots=slots, positions=positions,
                       n_actual=n)
    assert cls.counters["decode_qprep_fused"] == before["decode_qprep_fused"] + 1
    assert cls.counters["qk_norm_fused"] == before["qk_norm_fused"] + 1
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
    # And the layer output of the real rows is identical.
    assert torch.equal(stock["out"][:n], fused["out"][:n])


def test_mixed_prefill_decode_falls_through(test_mode, vctx):
    mla = test_mode
    cls = mla.KimiK3MultiHeadLatentAttentionWrapper
    slots = torch.tensor([5, 9, 33, -1])
    positions = torch.tensor([3, 4, 0, 0])
    before = dict(cls.counters)
    res = _run_layer(cls, seed=4, scales=(1.0, 1.0), slots=slots, positions=positions,
                     n_actual=3, prefills=1)
    assert cls.counters["decode_qprep_fused"] == before["decode_qprep_fused"]
    assert cls.counters["attn_stock"] == before["attn_stock"] + 1
    assert res["mha_rows"] == 1 and res["mqa_q"].shape[0] == 2  # the stock split


def test_profile_run_without_metadata_falls_through(test_mode, vctx):
    mla = test_mode
    cls = mla.KimiK3MultiHeadLatentAttentionWrapper
    w = mla_cpu.build_wrapper(cls, heads=4)
    _loaded(w)
    w.mla_attn._chunked_prefill_workspace_size = 16  # profile-run scratch size (CPU)
    before = dict(cls.counters)
    from vllm.forward_context import set_forward_context

    with set_forward_context(None, vctx, num_tokens=2,
                             slot_mapping={w.mla_attn.layer_name: torch.tensor([0, 1])}):
        out = w(torch.tensor([0, 1]), torch.randn(2, 256).to(torch.bfloat16))
    assert out.shape == (2, 256)
    assert cls.counters["attn_stock"] == before["attn_stock"] + 1


def test_dual_rmsnorm_reference_matches_vllm_rmsnorm(vctx):
    from vllm.model_executor.layers.layernorm import RMSNorm

    ref.register_dual_rms_norm_op()
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


def test_reference_kernel_contract():
    g = torch.Generator().manual_seed(2)
    t, h = 4, 2
    q_nope = torch.randn(t, h, 512, generator=g).to(torch.bfloat16)
    q_pe = torch.randn(t, h, 64, generator=g).to(torch.bfloat16)
    kv_c = torch.randn(t, 512, generator=g).to(torch.bfloat16)
    k_pe = torch.randn(t, 64, generator=g).to(torch.bfloat16)
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


# ------------------------------------------------------------------ wiring


def test_plugin_wiring_in_a_fresh_process(tmp_path):
    """vLLM's own plugin loader -> k3rocm_overlay -> amd.linear builds our wrapper.

    Needs k3rocm installed (entry point) and the overlay applied into this vLLM (the
    stand-in driver does both); on an upstream amd/mla.py vLLM it must stay out."""
    code = textwrap.dedent("""
        import json, os, sys
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        sys.path.insert(0, %r)
        import torch
        from k3rocm.testing import mla_cpu
        from k3rocm import vllm_plugin
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        import vllm.models.kimi_k3.amd.linear as lin
        from vllm.transformers_utils.configs.kimi_linear import KimiLinearConfig
        with mla_cpu.vllm_cpu_context():
            torch.set_default_dtype(torch.bfloat16)
            a = lin.KimiMLAAttention(KimiLinearConfig(), hidden_size=256, num_heads=16,
                qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=128,
                kv_lora_rank=512, use_nope=True, prefix="model.layers.0.self_attn")
        print("RESULT " + json.dumps({
            "class": type(a.mla_attn).__name__,
            "module": type(a.mla_attn).__module__,
            "ours": vllm_plugin.overlay_is_ours(),
            "bound": vllm_plugin._state["bound"]}))
    """) % str(REPO / "src")
    env = {k: v for k, v in os.environ.items() if not k.startswith("K3_")}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=env, timeout=300)
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert p.returncode == 0 and line, p.stderr[-3000:]
    res = json.loads(line[-1][7:])
    print(res)
    if res["ours"]:
        assert res["class"] == "KimiK3MultiHeadLatentAttentionWrapper"
        assert res["bound"] == ["vllm.models.kimi_k3.amd.linear"]
    else:  # upstream amd/mla.py (vLLM >= 0.32) or overlay not applied: plugin stays out
        assert res["bound"] == []
        expected = os.environ.get("K3_EXPECT_WIRING")
        if expected == "ours":
            pytest.fail("overlay expected to be applied and wired, but it is not")
