"""`k3rocm selftest model` on a synthetic checkpoint laid out as Kimi-K3's (kimi_k3_layout.py).
The expected slice: a checkpoint written from the *sliced* config by the same layout code."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from kimi_k3_layout import (
    ITEM,
    fuse_experts,
    real_config,
    small_config,
    tensors,
    truncate_data,
    write_checkpoint,
)
from safetensors import safe_open

from k3rocm import cli
from k3rocm.deploy import selftest_model as sm
from k3rocm.serving import modelfacts as mf

REPO = Path(__file__).resolve().parents[1]

NP = {"BF16": None, "F32": "<f4", "U8": "u1"}


def _read_all(d: Path) -> dict[str, tuple[str, tuple, np.ndarray]]:
    """Every tensor of checkpoint ``d``: (dtype, shape) by the safetensors library, values."""
    index = json.loads((d / sm.INDEX).read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(d / shard, framework="np") as f:
            meta = {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape()))
                    for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
        raw = (d / shard).read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
        for k, (dt, shape) in meta.items():
            b, e = header[k]["data_offsets"]
            buf = raw[8 + n + b:8 + n + e]
            if dt == "BF16":
                vals = (np.frombuffer(buf, "<u2").astype(np.uint32) << 16).view(np.float32)
            else:
                vals = np.frombuffer(buf, NP[dt])
            out[k] = (dt, shape, vals)
    assert set(out) == set(index["weight_map"])
    return out


def _layout(d: Path) -> dict[str, tuple[str, tuple]]:
    return {k: (dt, shape) for k, (dt, shape, _) in _read_all(d).items()}


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("ckpt") / "Kimi-K3"
    write_checkpoint(d)
    return d


def _slice(src: Path, out: Path, *argv: str) -> int:
    return cli.main(["selftest", "model", str(src), str(out), *argv])


def test_default_slice_has_the_real_layout_of_its_config(src, tmp_path, capsys):
    out = tmp_path / "slice"
    assert _slice(src, out) == 0
    cfg = json.loads((out / "config.json").read_text())
    tc = cfg["text_config"]
    # the shortest prefix with KDA, MLA and MoE layers: K3's pattern KDA KDA KDA MLA
    assert tc["num_hidden_layers"] == 4
    assert tc["linear_attn_config"]["kda_layers"] == [1, 2, 3]
    assert tc["linear_attn_config"]["full_attn_layers"] == [4]
    assert tc["num_nextn_predict_layers"] == 1
    assert tc["num_experts"] == 4  # 2 x num_experts_per_token
    assert tc["first_k_dense_replace"] == 1
    rec = cfg[sm.SLICE_KEY]
    assert [(x["source"], x["slice"], x["kind"]) for x in rec["layers"]] == [
        (0, 0, "KDA+dense"), (1, 1, "KDA+MoE"), (2, 2, "KDA+MoE"), (3, 3, "MLA+MoE")]
    assert rec["mtp_layers"] == [{"source": 8, "slice": 4}]
    assert rec["experts"] == {"kept": [0, 1, 2, 3], "source_num_experts": 16}
    assert rec["source_config_sha256"] and rec["source_index_sha256"]
    # names, dtypes and shapes are exactly those of a checkpoint with the sliced config
    expected = tensors(cfg)
    assert _layout(out) == expected
    assert rec["tensors"] == len(expected)
    idx = json.loads((out / sm.INDEX).read_text())
    total = sum(math.prod(s) * ITEM[dt] for dt, s in expected.values())
    assert idx["metadata"]["total_size"] == total
    # tokenizer files pass through; the report names what was written
    assert (out / "tiktoken.model").read_bytes() == (src / "tiktoken.model").read_bytes()
    assert (out / "tokenizer_config.json").is_file()
    text = capsys.readouterr().out
    assert f"{len(expected)} of {len(tensors(small_config()))} tensors" in text
    assert "3->3 MLA+MoE" in text and "MTP: 8->4" in text


def test_values_are_valid_quantized_and_finite(src, tmp_path):
    out = tmp_path / "slice"
    assert _slice(src, out, "--experts", "3") == 0  # odd: still exactly its config's layout
    assert _layout(out) == tensors(json.loads((out / "config.json").read_text()))
    got = _read_all(out)
    packed = scales = 0
    for name, (dt, _, vals) in got.items():
        if name.endswith(".weight_scale"):
            scales += 1
            assert dt == "U8" and vals.max() < 255  # E8M0: 255 is NaN
            assert 2.0 ** (vals.astype(int) - 127).min() > 0
        elif name.endswith(".weight_packed"):
            packed += 1  # any byte is two finite e2m1 values
            assert dt == "U8" and len(np.unique(vals)) > 16
        else:
            assert np.isfinite(vals).all(), name
            if name.endswith("norm.weight"):
                assert (vals == 1).all(), name
            elif vals.size > 64:
                assert vals.std() > 0, name
    # 4 MoE layers (3 decoder + MTP) x 3 experts x (w1, w2, w3)
    assert packed == scales == 4 * 3 * 3


def test_explicit_layers_renumber_in_real_order_with_mtp_after(src, tmp_path):
    out = tmp_path / "slice"
    assert _slice(src, out, "--layers", "7,2,3", "--experts", "2") == 0
    cfg = json.loads((out / "config.json").read_text())
    tc = cfg["text_config"]
    assert [(x["source"], x["slice"]) for x in cfg[sm.SLICE_KEY]["layers"]] == [
        (2, 0), (3, 1), (7, 2)]
    assert tc["linear_attn_config"]["kda_layers"] == [1]  # source layer 2 (1-based 3)
    assert tc["linear_attn_config"]["full_attn_layers"] == [2, 3]
    assert tc["first_k_dense_replace"] == 0  # all kept layers are MoE
    names = set(json.loads((out / sm.INDEX).read_text())["weight_map"])
    assert names == set(tensors(cfg))
    p = "language_model.model.layers."
    assert f"{p}3.eh_proj.weight" in names  # the MTP layer follows the kept layers
    assert f"{p}2.self_attn.kv_b_proj.weight" in names  # source layer 7, MLA
    assert f"{p}0.self_attn.A_log" in names  # source layer 2, KDA
    assert f"{p}0.block_sparse_moe.experts.2.w1.weight_packed" not in names
    ignore = tc["quantization_config"]["ignore"]
    assert [x for x in ignore if not x.startswith(("re:", "lm_head"))] == [
        f"{p}0.mlp.gate_proj", f"{p}1.mlp.gate_proj", f"{p}2.mlp.gate_proj"]
    assert _slice(src, tmp_path / "no-mtp", "--no-mtp") == 0
    cfg = json.loads((tmp_path / "no-mtp" / "config.json").read_text())
    assert cfg["text_config"]["num_nextn_predict_layers"] == 0
    assert set(json.loads((tmp_path / "no-mtp" / sm.INDEX).read_text())["weight_map"]) == \
        set(tensors(cfg))


def test_reads_headers_only(src, tmp_path):
    """Shards with no data, or all 0xff (NaN), slice to the same bytes as complete ones."""
    full, cut, poisoned = tmp_path / "full", tmp_path / "cut", tmp_path / "poisoned"
    full.mkdir()
    write_checkpoint(cut / "src")
    truncate_data(cut / "src")
    write_checkpoint(poisoned / "src", fill=0xFF)
    assert sum(f.stat().st_size for f in (cut / "src").glob("*.safetensors")) < 200_000
    for d, s in ((full, src), (cut, cut / "src"), (poisoned, poisoned / "src")):
        assert _slice(s, d / "out") == 0
    for shard in (full / "out").glob("*.safetensors"):
        ref = shard.read_bytes()
        assert (cut / "out" / shard.name).read_bytes() == ref
        assert (poisoned / "out" / shard.name).read_bytes() == ref


def test_output_is_atomic(src, tmp_path, monkeypatch, capsys):
    out = tmp_path / "slice"
    out.mkdir()
    (out / "keep").write_text("x")
    assert _slice(src, out) == 2
    assert "exists" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep"]

    out2 = tmp_path / "slice2"
    real, calls = sm.write_shard, []

    def dies_after_first(path, *a, **kw):
        calls.append(path)
        if len(calls) > 1:
            raise KeyboardInterrupt
        return real(path, *a, **kw)

    monkeypatch.setattr(sm, "write_shard", dies_after_first)
    assert _slice(src, out2, "--shard-gb", "0.002") == 130
    assert len(calls) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["slice"]  # no OUT, no partial dir


def _bad(tmp_path: Path, capsys, argv: list[str]) -> str:
    assert cli.main(["selftest", "model", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("k3rocm: error: ") and "\n" not in err and "Traceback" not in err
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())
    return err


def test_bad_input_is_one_line_exit_2(src, tmp_path, capsys):
    o = str(tmp_path / "o")
    assert "not a directory" in _bad(tmp_path, capsys, [str(tmp_path / "nope"), o])
    assert "parent directory" in _bad(tmp_path, capsys, [str(src), str(tmp_path / "a" / "b")])
    assert "MLA and one KDA" in _bad(tmp_path, capsys, [str(src), o, "--layers", "0,1"])
    assert "not in 0..7" in _bad(tmp_path, capsys, [str(src), o, "--layers", "3,8"])
    assert "comma-separated" in _bad(tmp_path, capsys, [str(src), o, "--layers", "a"])
    assert "num_experts_per_token" in _bad(tmp_path, capsys, [str(src), o, "--experts", "1"])
    assert "num_experts (16)" in _bad(tmp_path, capsys, [str(src), o, "--experts", "17"])

    broken = tmp_path / "broken"
    write_checkpoint(broken)
    (broken / sm.INDEX).unlink()
    assert "safetensors index" in _bad(tmp_path, capsys, [str(broken), o])
    write_checkpoint(broken)
    sorted(broken.glob("*.safetensors"))[0].unlink()
    assert "not there" in _bad(tmp_path, capsys, [str(broken), o])

    # a layer that would change from dense to MoE (moe_layer_freq 2: odd layers are dense)
    freq = tmp_path / "freq"
    cfg = small_config()
    cfg["text_config"].update(moe_layer_freq=2, first_k_dense_replace=0)
    write_checkpoint(freq, cfg)
    err = _bad(tmp_path, capsys, [str(freq), o, "--layers", "1,2,3"])
    assert "layer 2 is MoE in the source but would be dense as layer 1" in err

    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text('{"text_config": {"num_hidden_layers": 2}}')
    assert "linear_attn_config" in _bad(tmp_path, capsys, [str(plain), o])


def test_packed_mx_dtypes_round_trip(tmp_path):
    """Packed OCP MX dtypes (F4, F6) and E8M0 are written as the safetensors library reads
    them."""
    specs = [sm.Tensor("w.weight", "F4", (4, 64)), sm.Tensor("w.weight_scale", "F8_E8M0", (4, 2)),
             sm.Tensor("v.weight", "F6_E2M3", (2, 32))]
    path = tmp_path / "x.safetensors"
    sm.write_shard(path, [(t, t) for t in specs], tmp_path, seed=1)
    with safe_open(path, framework="np") as f:
        got = {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    assert got == {t.name: (t.dtype, list(t.shape)) for t in specs}
    assert [t.nbytes for t in specs] == [128, 8, 48]
    assert sm.read_layout(path)[0]["w.weight"].nbytes == 128


def test_the_table_is_kimi_k3s_published_config():
    """modelfacts.KIMI_K3 holds the published numbers (written out here, not read from the
    table), each with a source; the census test config and the synthetic one agree."""
    published = {
        "num_hidden_layers": 93, "hidden_size": 7168, "vocab_size": 163840,
        "num_attention_heads": 96, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "num_experts": 896, "num_experts_per_token": 16, "num_shared_experts": 2,
        "moe_intermediate_size": 3072, "routed_expert_hidden_size": 3584,
        "intermediate_size": 33792, "first_k_dense_replace": 1, "attn_res_block_size": 12}
    assert {k: v for k, (v, _) in mf.KIMI_K3.items()} == published
    for key, (_, source) in mf.KIMI_K3.items():
        assert "Kimi-K3.yaml" in source and mf.CONFIG_REVISION in source, key
    assert "dense_intermediate_size" in mf.KIMI_K3["intermediate_size"][1]
    assert "attention_residual_block_size" in mf.KIMI_K3["attn_res_block_size"][1]
    mla = [4 * i for i in range(1, 24)] + [93]
    assert list(mf.KIMI_K3_MLA_LAYERS) == mla
    kda = [i for i in range(1, 94) if i not in mla]  # 69
    assert (mf.KIMI_K3_GROUP_SIZE, mf.KIMI_K3_QUANT_FORMAT) == (32, "mxfp4-pack-quantized")
    census = json.loads((REPO / "tests/data/census/models/kimi-k3/config.json").read_text())
    for tc in (census["text_config"], real_config()["text_config"]):
        assert {k: tc[k] for k in published if k in tc} == {k: published[k] for k in published
                                                          if k in tc}
        assert tc["linear_attn_config"]["full_attn_layers"] == mla
        assert tc["linear_attn_config"]["kda_layers"] == kda
    assert set(published) <= set(real_config()["text_config"])


def test_the_synthetic_real_layout_weighs_what_the_checkpoint_does():
    """At the published dimensions the synthetic layout sums to within 1% of the checkpoint's
    ~1.56 TB (Kimi-K2's layout would be ~1 TB)."""
    specs = tensors(real_config())
    total = sum(math.prod(s) * ITEM[dt] for dt, s in specs.values())
    assert abs(total / mf.KIMI_K3_CHECKPOINT_BYTES - 1) < 0.01, total
    p = "language_model.model.layers.5.block_sparse_moe."
    assert specs[p + "experts.895.w1.weight_packed"] == ("U8", (3072, 3584 // 2))
    assert specs[p + "experts.895.w2.weight_scale"] == ("U8", (3584, 3072 // 32))
    assert specs[p + "gate.weight"] == ("BF16", (896, 7168))
    assert specs[p + "routed_expert_down_proj.weight"] == ("BF16", (3584, 7168))
    assert specs[p + "shared_experts.up_proj.weight"] == ("BF16", (2 * 3072, 7168))
    assert specs["language_model.model.layers.0.mlp.up_proj.weight"] == ("BF16", (33792, 7168))
    assert f"{p}experts.896.w1.weight_packed" not in specs


def test_a_fused_expert_layout_is_refused_not_cut_inconsistently(tmp_path, capsys):
    """Fused [E, ...] expert tensors: refused (exit 2) unless every expert is kept."""
    fused = tmp_path / "fused"
    write_checkpoint(fused, specs=fuse_experts(tensors(small_config())))
    names = json.loads((fused / sm.INDEX).read_text())["weight_map"]
    assert "language_model.model.layers.1.block_sparse_moe.experts.w13_weight_packed" in names
    err = _bad(tmp_path, capsys, [str(fused), str(tmp_path / "o")])
    assert "experts.w13_weight" in err and "fused" in err and "--experts 16" in err
    assert not (tmp_path / "o").exists()
    out = tmp_path / "all"
    assert _slice(fused, out, "--experts", "16") == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["text_config"]["num_experts"] == 16
    assert _layout(out) == fuse_experts(tensors(cfg))  # the fused tensors whole, [16, ...]


def test_inconsistent_expert_sets_are_refused(tmp_path, capsys):
    specs = tensors(small_config())
    p = "language_model.model.layers.2.block_sparse_moe."
    for name, layout, fragments in (
            ("gap", {k: v for k, v in specs.items() if not k.startswith(p + "experts.1.")},
             ("source layer 2", "experts 0..3 (3)")),
            ("odd", {k: v for k, v in specs.items() if k != p + "experts.2.w3.weight_scale"},
             ("do not all have the same tensors",)),
            ("extra", {**specs, p + "experts.16.w1.weight_packed": ("U8", (128, 64))},
             ("expert 16", "num_experts 16")),
            ("router", {**specs, p + "gate.weight": ("BF16", (15, 256))}, ("router", "[15, 256]"))):
        write_checkpoint(tmp_path / name, specs=layout)
        err = _bad(tmp_path, capsys, [str(tmp_path / name), str(tmp_path / "o")])
        assert all(f in err for f in fragments), (name, err)


def test_the_slice_of_the_real_layout(capsys):
    """The plan on Kimi-K3's published layout (no I/O): exactly the sliced config's tensors."""
    cfg = real_config()
    specs = tensors(cfg)
    p = sm.plan(cfg, sm.parse_layers(None, sm.text_config(cfg)), None, True)
    kept = [t for n, (dt, shape) in specs.items()
            if (t := sm.slice_tensor(sm.Tensor(n, dt, shape), p)) is not None]
    sm.check_experts([t.name for t in kept], p)
    tc = p.config["text_config"]
    assert (tc["num_hidden_layers"], tc["num_experts"], tc["num_experts_per_token"]) == (4, 32, 16)
    assert tc["linear_attn_config"]["full_attn_layers"] == [4]
    assert {t.name: (t.dtype, t.shape) for t in kept} == tensors(p.config)
    assert len(kept) < 1000 < len(specs)
