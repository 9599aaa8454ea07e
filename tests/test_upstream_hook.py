"""The upstream hook against the real vLLM 0.30.0 ... 0.34.0 amd/mla.py: the fusion table's
attributes are decided in upstream's ``__init__`` only and read where the fused path is chosen
(per release, written by hand from the files), and the hook's logic on a layer-shaped object.
The hook inside real vLLM: test_overlay_standin.py."""

from __future__ import annotations

import ast
import logging
from types import SimpleNamespace

import pytest
from conftest import upstream_tree

from k3rocm.serving import decisions, upstream_hook
from k3rocm.serving.fusions import BY_NAME

CLASS = "KimiK3MultiHeadLatentAttentionWrapper"
MLA = "vllm/models/kimi_k3/amd/mla.py"
# release -> the attributes its amd/mla.py has (read from the files)
HAS = {
    "0.30.0": {"_use_eager_qk_rmsnorm_fusion"},
    "0.31.0": {"_use_eager_qk_rmsnorm_fusion"},
    "0.32.0": {"_use_eager_qk_rmsnorm_fusion", "_fused_qk_prep"},
    "0.33.0": {"_use_eager_qk_rmsnorm_fusion", "_fused_qk_prep"},
    "0.34.0": {"_use_eager_qk_rmsnorm_fusion", "_fused_qk_prep", "_fold_qb_uk",
               "_zero_positions"},
}
ALL = set().union(*HAS.values())


def _class(version: str) -> ast.ClassDef:
    tree = ast.parse((upstream_tree(version) / MLA).read_text())
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == CLASS]
    return cls


def _methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}


def _self_attr(node: ast.AST, ctx: type) -> str | None:
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "self" and isinstance(node.ctx, ctx)):
        return node.attr
    return None


def _assigned(fn: ast.AST) -> dict[str, ast.AST]:
    """self.<x> assigned in fn (and buffers registered by name) -> the assigned value."""
    out: dict[str, ast.AST] = {}
    for n in ast.walk(fn):
        if isinstance(n, (ast.Assign, ast.AnnAssign)) and n.value is not None:
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                if _self_attr(t, ast.Store):
                    out[t.attr] = n.value
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                and n.func.attr == "register_buffer"):
            out[n.args[0].value] = n.args[1]
    return out


def _reads(node: ast.AST) -> set[str]:
    return {a for n in ast.walk(node) if (a := _self_attr(n, ast.Load))}


def _call_names(node: ast.AST) -> set[str]:
    return {n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
            for n in ast.walk(node) if isinstance(n, ast.Call)}


def _guarded_calls(fn: ast.FunctionDef, attr: str) -> set[str]:
    """Calls made only under an ``if`` whose test reads ``self.attr``, directly or through a
    local name assigned from an expression reading it (``fuse = self._fused_qk_prep and ...``)."""
    locals_ = {t.id for n in ast.walk(fn) if isinstance(n, ast.Assign) and attr in _reads(n.value)
               for t in n.targets if isinstance(t, ast.Name)}
    out: set[str] = set()
    for n in ast.walk(fn):
        if isinstance(n, ast.If):
            names = {x.id for x in ast.walk(n.test) if isinstance(x, ast.Name)}
            if attr in _reads(n.test) or names & locals_:
                out |= set().union(*(_call_names(b) for b in n.body))
    return out


@pytest.mark.parametrize("version", sorted(HAS))
def test_fusion_attributes_are_decided_in_init_and_read_where_the_path_is_chosen(version):
    cls = _class(version)
    m = _methods(cls)
    init = _assigned(m["__init__"])
    has = HAS[version]
    # present exactly where the release has them; absent from the whole file otherwise
    text = (upstream_tree(version) / MLA).read_text()
    for name in ALL:
        assert (name in init) is (name in has), (version, name)
        assert (name in text) is (name in has), (version, name)
    # decided in __init__ only: nothing later undoes what the hook set
    for meth, fn in m.items():
        if meth != "__init__":
            assert not (set(_assigned(fn)) & ALL), (version, meth)
    # q/kv RMSNorm: __init__ sets a bool, _normalize_q_kv calls the fused op under it
    qk = BY_NAME["qk_norm"]
    assert qk.attr == "_use_eager_qk_rmsnorm_fusion"
    assert _call_names(init[qk.attr]) == {"bool", "is_enabled"}
    assert qk.op in _guarded_calls(m["_normalize_q_kv"], qk.attr)
    qp = BY_NAME["decode_qprep"]
    assert qp.attr == "_fused_qk_prep"
    if qp.attr not in has:
        return
    # decode Q-prep: __init__ asks its gate method (bools only), forward takes _fused_decode
    # under it, and _fused_decode is where the fused op is called
    assert _call_names(init[qp.attr]) == {"_fused_qk_prep_supported"}
    rets = [r.value for r in ast.walk(m["_fused_qk_prep_supported"]) if isinstance(r, ast.Return)]
    assert any(isinstance(r, ast.Constant) and r.value is False for r in rets)
    assert "_fused_decode" in _guarded_calls(m["forward"], qp.attr)
    assert qp.op in _call_names(m["_fused_decode"])
    assert set(qp.follows) == {"_fold_qb_uk", "_zero_positions"}
    if "_fold_qb_uk" in has:  # 0.34: fold and zero positions are built only for Q-prep
        assert qp.attr in _reads(init["_fold_qb_uk"])
        assert _guarded_calls(m["process_weights_after_loading"], "_fold_qb_uk") == {
            "_build_w_fold"}
        assert "_fold_qb_uk" in _reads(m["forward"])
        zero = [n for n in ast.walk(m["__init__"]) if isinstance(n, ast.If)
                and qp.attr in _reads(n.test) and "zeros" in _call_names(n)]
        assert zero, "_zero_positions allocated outside `if self._fused_qk_prep`"
        users = {k for k, fn in m.items() if "_zero_positions" in _reads(fn)}
        assert users == {"_fused_decode"}


# release -> (op calls, attributes its __init__ sets: name -> first line), read from the files;
# None: no amd/mla.py
READ = {
    "0.27.1": None, "0.28.0": None, "0.29.0": None,
    "0.30.0": ({"fused_mla_dual_rms_norm": 30}, {"_use_eager_qk_rmsnorm_fusion": 19}),
    "0.31.0": ({"fused_mla_dual_rms_norm": 30}, {"_use_eager_qk_rmsnorm_fusion": 19}),
    "0.32.0": ({"fused_mla_dual_rms_norm": 81, "fused_qk_rope_concat_and_cache_mla": 168},
               {"_use_eager_qk_rmsnorm_fusion": 31, "_fused_qk_prep": 32}),
    "0.33.0": ({"fused_mla_dual_rms_norm": 93, "fused_qk_rope_concat_and_cache_mla": 181},
               {"_use_eager_qk_rmsnorm_fusion": 32, "_fused_qk_prep": 33}),
    "0.34.0": ({"fused_mla_dual_rms_norm": 122, "fused_qk_rope_concat_and_cache_mla": 283},
               {"_use_eager_qk_rmsnorm_fusion": 38, "_fused_qk_prep": 39, "_zero_positions": 62,
                "_fold_qb_uk": 65}),
}
OPS = ("fused_mla_dual_rms_norm", "fused_qk_rope_concat_and_cache_mla")


@pytest.mark.parametrize("version", READ)
def test_read_mla_on_every_release(version):
    """The one reader of upstream's amd/mla.py (overlay, base facts and hook ask it)."""
    path = upstream_tree(version) / MLA
    if READ[version] is None:
        assert not path.is_file()
        return
    calls, sets = READ[version]
    mla = upstream_hook.read_mla(path.read_text())
    assert {k: v for k, v in mla.calls.items() if k in OPS} == calls
    assert {k: v for k, v in mla.init.items() if k in ALL} == sets
    assert mla.shipped == (["qk_norm"] if len(calls) == 1 else ["qk_norm", "decode_qprep"])


def test_shipped_needs_the_op_call_and_the_attribute_in_init():
    """The fusion table decides (op called, attr set in ``__init__``), not a version number,
    nor a mention in a docstring or a setting outside ``__init__``."""
    both = (upstream_tree("0.34.0") / MLA).read_text()

    def shipped(text):
        return upstream_hook.read_mla(text).shipped

    assert shipped(both) == ["qk_norm", "decode_qprep"]
    assert shipped(both.replace("self._fused_qk_prep", "self._qprep")) == ["qk_norm"]
    assert shipped(both.replace("fused_qk_rope_concat_and_cache_mla(", "other_kernel(")) == [
        "qk_norm"]
    init = "        self._fused_qk_prep = self._fused_qk_prep_supported()\n"
    moved = both.replace(init, init.replace("_fused_qk_prep =", "_qprep ="))
    assert moved != both
    assert shipped(moved + "\n\ndef later(self):\n    self._fused_qk_prep = True\n") == [
        "qk_norm"]
    assert shipped('"""fused_mla_dual_rms_norm(x) and self._use_eager_qk_rmsnorm_fusion"""') \
        == []
    assert shipped("not python (") == []


# ------------------------------------------- the hook's own logic on a layer-shaped object
# (the real class: hook_cases.py in the stand-in)


class _Layer:
    def __init__(self, qk=True, qprep=True, **more):
        self._use_eager_qk_rmsnorm_fusion = qk
        self._fused_qk_prep = qprep
        self.mla_attn = SimpleNamespace(layer_name="model.layers.3.self_attn.attn")
        self._buffers = {}
        for k, v in more.items():
            setattr(self, k, v)


@pytest.fixture
def hooked(monkeypatch, tmp_path, caplog):
    """The hook with no switch set, a fresh writer, its records in ``caplog``."""
    caplog.set_level(logging.INFO, logger="vllm.k3rocm")
    for f in BY_NAME.values():
        monkeypatch.delenv(f.env, raising=False)
    monkeypatch.setenv("K3_PROFILER_DIR", str(tmp_path))
    monkeypatch.setattr(upstream_hook, "WRITER", decisions.Writer())
    monkeypatch.setattr(upstream_hook, "_warned", set())
    return upstream_hook


def _records(caplog):
    return [r for r in map(decisions.parse_line, caplog.messages) if r]


def test_asked_off_switches_the_attribute_and_its_followers(hooked, monkeypatch, caplog):
    monkeypatch.setenv("K3_FUSE_DECODE_QPREP", "0")
    layer = _Layer(_fold_qb_uk=True)
    hooked.after_init(layer)
    assert layer._fused_qk_prep is False and layer._fold_qb_uk is False
    assert layer._use_eager_qk_rmsnorm_fusion is True
    [rec] = _records(caplog)
    assert rec["writer"] == "upstream" and rec["phase"] == "construct"
    assert rec["asked"] == {"qk_norm": True, "decode_qprep": False}
    assert rec["fusions"] == {
        "qk_norm": {"state": "on", "reason": "upstream's gates: on"},
        "decode_qprep": {"state": "off", "reason": "K3_FUSE_DECODE_QPREP=0 (hook)"}}
    decisions.parse_record(rec, "log")  # k3rocm's reader takes it


def test_state_is_read_from_the_attribute_not_from_what_was_asked(hooked, monkeypatch, caplog):
    """Asked on, upstream's gate off: the record says off (upstream's gates)."""
    layer = _Layer(qk=True, qprep=False)
    hooked.after_init(layer)
    [rec] = _records(caplog)
    assert rec["asked"] == {"qk_norm": True, "decode_qprep": True}
    assert rec["fusions"]["decode_qprep"] == {"state": "off", "reason": "upstream's gates: off"}


def test_a_switch_that_does_not_take_is_reported_on(hooked, monkeypatch, caplog):
    class Sticky(_Layer):
        def __setattr__(self, name, value):
            if name != "_use_eager_qk_rmsnorm_fusion" or "_use_eager_qk_rmsnorm_fusion" not in (
                    self.__dict__):
                object.__setattr__(self, name, value)

    monkeypatch.setenv("K3_FUSE_QK_NORM", "0")
    hooked.after_init(Sticky())
    [rec] = _records(caplog)
    assert rec["fusions"]["qk_norm"]["state"] == "on"
    assert "did not take" in rec["fusions"]["qk_norm"]["reason"]


def test_missing_or_non_bool_attributes_are_unknown_with_one_warning(hooked, monkeypatch,
                                                                     caplog):
    monkeypatch.setenv("K3_FUSE_QK_NORM", "0")
    monkeypatch.setenv("K3_FUSE_DECODE_QPREP", "0")
    odd = _Layer(qk=1)
    del odd._fused_qk_prep
    hooked.after_init(odd)
    hooked.after_init(_Layer(qk=1, qprep=None))
    assert odd._use_eager_qk_rmsnorm_fusion == 1  # untouched
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "not switchable" in warnings[0].getMessage()
    recs = _records(caplog)
    assert [r["fusions"]["qk_norm"]["state"] for r in recs] == ["unknown", "unknown"]
    assert "_use_eager_qk_rmsnorm_fusion = int 1, not a bool" in recs[0]["fusions"]["qk_norm"][
        "reason"]
    assert "has no _fused_qk_prep" in recs[0]["fusions"]["decode_qprep"]["reason"]
    assert "_fused_qk_prep = NoneType None" in recs[1]["fusions"]["decode_qprep"]["reason"]


def test_a_bad_switch_keeps_upstreams_decision(hooked, monkeypatch, caplog):
    monkeypatch.setenv("K3_FUSE_QK_NORM", "maybe")
    layer = _Layer()
    hooked.after_init(layer)
    assert layer._use_eager_qk_rmsnorm_fusion is True
    [rec] = _records(caplog)
    assert rec["asked"]["qk_norm"] is None
    assert rec["fusions"]["qk_norm"]["state"] == "on"
    assert "K3_FUSE_QK_NORM='maybe' is not a switch; use 1 or 0" in rec["fusions"]["qk_norm"][
        "reason"]


def test_an_error_in_the_hook_leaves_upstream_alone(hooked, monkeypatch, caplog):
    monkeypatch.setenv("K3_FUSE_QK_NORM", "0")
    monkeypatch.setenv("K3_FUSE_DECODE_QPREP", "0")

    class Breaks(_Layer):
        def __setattr__(self, name, value):
            if name == "_fused_qk_prep" and "_fused_qk_prep" in self.__dict__:
                raise RuntimeError("read-only here")
            object.__setattr__(self, name, value)

    layer = Breaks()
    hooked.after_init(layer)  # does not raise
    assert layer._use_eager_qk_rmsnorm_fusion is True and layer._fused_qk_prep is True
    [rec] = _records(caplog)
    assert {v["state"] for v in rec["fusions"].values()} == {"unknown"}
    assert "hook error (RuntimeError: read-only here)" in rec["fusions"]["qk_norm"]["reason"]


def test_install_wraps_init_once(hooked, monkeypatch, caplog):
    mod = SimpleNamespace(__name__="fake.amd.mla")

    class KimiK3MultiHeadLatentAttentionWrapper(_Layer):
        pass

    mod.KimiK3MultiHeadLatentAttentionWrapper = KimiK3MultiHeadLatentAttentionWrapper
    monkeypatch.setenv("K3_FUSE_QK_NORM", "0")
    assert hooked.install(mod) and hooked.install(mod)
    layer = KimiK3MultiHeadLatentAttentionWrapper()
    assert layer._use_eager_qk_rmsnorm_fusion is False
    assert len(_records(caplog)) == 1
    assert not hooked.install(SimpleNamespace(__name__="x"))  # no class: one warning, False
