"""`k3rocm selftest model`: the slicer on a synthetic checkpoint laid out as the real Kimi-K3 one
(names, dtypes, MXFP4 layout: see tests/kimi_k3_layout.py for the vLLM 0.27.1 lines they follow).

The expected slice is derived independently: a checkpoint written from the *sliced* config by
the same layout code must have exactly the slice's names, dtypes and shapes (layers renumbered,
MTP after the kept layers, experts 0..k-1, router cut to k rows)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from kimi_k3_layout import small_config, tensors, truncate_data, write_checkpoint
from safetensors import safe_open

from k3rocm import cli
from k3rocm.deploy import selftest_model as sm

NP = {"BF16": None, "F32": "<f4", "U8": "u1"}


def _read_all(d: Path) -> dict[str, tuple[str, tuple, np.ndarray]]:
    """Every tensor of checkpoint ``d`` through its index: (dtype, shape, raw values).

    Names/dtypes/shapes come from the safetensors library (an independent reader of the
    format); values are decoded here (bf16 -> float32 by widening)."""
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
    got = _read_all(out)
    assert {k: (dt, shape) for k, (dt, shape, _) in got.items()} == expected
    assert rec["tensors"] == len(expected)
    idx = json.loads((out / sm.INDEX).read_text())
    total = sum(math.prod(s) * {"BF16": 2, "F32": 4, "U8": 1}[dt] for dt, s in expected.values())
    assert idx["metadata"]["total_size"] == total
    # tokenizer files pass through; the report names what was written
    assert (out / "tiktoken.model").read_bytes() == (src / "tiktoken.model").read_bytes()
    assert (out / "tokenizer_config.json").is_file()
    text = capsys.readouterr().out
    assert f"{len(expected)} of {len(tensors(small_config()))} tensors" in text
    assert "3->3 MLA+MoE" in text and "MTP: 8->4" in text


def test_values_are_valid_quantized_and_finite(src, tmp_path):
    out = tmp_path / "slice"
    assert _slice(src, out, "--experts", "3") == 0
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


def test_no_mtp(src, tmp_path):
    out = tmp_path / "slice"
    assert _slice(src, out, "--no-mtp") == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["text_config"]["num_nextn_predict_layers"] == 0
    assert set(json.loads((out / sm.INDEX).read_text())["weight_map"]) == set(tensors(cfg))


def test_reads_headers_only(src, tmp_path):
    """Shards cut right after their headers (no data at all) slice to the same bytes as the
    complete shards, and shards whose data is all 0xff (NaN in bf16, NaN in E8M0) do too: the
    slicer neither needs nor copies the source's data."""
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
    first = sorted(broken.glob("*.safetensors"))[0]
    first.write_bytes(b"\x10\x00")
    assert "not a safetensors file" in _bad(tmp_path, capsys, [str(broken), o])
    first.unlink()
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
    """safetensors' packed OCP MX dtypes (F4: two e2m1 per byte, F6) and E8M0 are written as
    the safetensors library reads them."""
    specs = [sm.Tensor("w.weight", "F4", (4, 64)), sm.Tensor("w.weight_scale", "F8_E8M0", (4, 2)),
             sm.Tensor("v.weight", "F6_E2M3", (2, 32))]
    path = tmp_path / "x.safetensors"
    sm.write_shard(path, [(t, t) for t in specs], tmp_path, seed=1)
    with safe_open(path, framework="np") as f:
        got = {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    assert got == {t.name: (t.dtype, list(t.shape)) for t in specs}
    assert [t.nbytes for t in specs] == [128, 8, 48]
    assert sm.read_header(path)["w.weight"].nbytes == 128


def test_help():
    with pytest.raises(SystemExit) as e:
        cli.main(["selftest", "model", "--help"])
    assert e.value.code == 0
