"""The plugin's post-import hook without vLLM (the real wiring: test_overlay_image.py)."""

from __future__ import annotations

import importlib
import sys

from conftest import REPO

from k3rocm.serving import vllm_plugin


def test_finder_binds_the_named_module_after_it_runs(tmp_path, monkeypatch):
    pkg = tmp_path / "k3fakepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "linear.py").write_text("MultiHeadLatentAttentionWrapper = 'base'\n")
    (pkg / "other.py").write_text("X = 1\n")
    seen = []
    monkeypatch.syspath_prepend(str(tmp_path))
    finder = vllm_plugin._Finder({"k3fakepkg.linear": lambda m: seen.append(
        (m.__name__, m.MultiHeadLatentAttentionWrapper))})
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    try:
        importlib.import_module("k3fakepkg.other")
        assert seen == []
        importlib.import_module("k3fakepkg.linear")
        importlib.import_module("k3fakepkg.linear")  # cached: not executed, not bound again
        assert seen == [("k3fakepkg.linear", "base")]
        assert set(finder.hooks) == {"k3fakepkg.linear"} and not finder._busy
    finally:
        for name in ("k3fakepkg", "k3fakepkg.linear", "k3fakepkg.other"):
            sys.modules.pop(name, None)


def _fake_vllm(tmp_path, monkeypatch, mla_text):
    """A ``vllm`` package whose amd/mla.py is ``mla_text`` (None: no such file)."""
    amd = tmp_path / "vllm" / "models" / "kimi_k3" / "amd"
    amd.mkdir(parents=True)
    for d in (amd, *amd.parents):
        if d == tmp_path:
            break
        (d / "__init__.py").write_text("")
    if mla_text is not None:
        (amd / "mla.py").write_text(mla_text)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.setattr(vllm_plugin, "_state", {"registered": False, "bound": [],
                                                "upstream_hook": False})
    monkeypatch.delenv("K3_OVERLAY", raising=False)
    return amd


UPSTREAM_LIKE = """
class KimiK3MultiHeadLatentAttentionWrapper:
    def __init__(self):
        self._use_eager_qk_rmsnorm_fusion = True
        self.mla_attn = None
"""


def _drop(prefix):
    for name in [m for m in sys.modules if m == prefix or m.startswith(prefix + ".")]:
        sys.modules.pop(name, None)


def test_upstream_amd_mla_gets_the_hook(tmp_path, monkeypatch):
    """On a base whose amd/mla.py is upstream's, register() hooks that module (and only on
    import: nothing of Kimi-K3 is imported by the plugin itself)."""
    _fake_vllm(tmp_path, monkeypatch, UPSTREAM_LIKE)
    monkeypatch.setenv("K3_FUSE_QK_NORM", "0")
    try:
        vllm_plugin.register()
        assert vllm_plugin._state["upstream_hook"] is True
        assert "vllm.models.kimi_k3.amd.mla" not in sys.modules
        mod = importlib.import_module("vllm.models.kimi_k3.amd.mla")
        layer = mod.KimiK3MultiHeadLatentAttentionWrapper()
        assert layer._use_eager_qk_rmsnorm_fusion is False
    finally:
        _drop("vllm")


def test_no_hook_on_the_overlay_without_amd_mla_or_with_k3_overlay_off(tmp_path, monkeypatch):
    for i, (text, env) in enumerate(((vllm_plugin.MARKER + "\n", None), (None, None),
                                     (UPSTREAM_LIKE, "off"))):
        root = tmp_path / str(i)
        root.mkdir()
        _fake_vllm(root, monkeypatch, text)
        if env:
            monkeypatch.setenv("K3_OVERLAY", env)
        try:
            vllm_plugin.register()
            assert vllm_plugin._state["upstream_hook"] is False, (text, env)
        finally:
            _drop("vllm")
            monkeypatch.undo()


def test_the_bind_double_rebinds_a_named_model_and_the_product_does_not(tmp_path, monkeypatch):
    """K3_TEST_BIND_MODULES is read by the test-only plugin tests/doubles/k3rocm_test_bind.py
    (the CPU end-to-end tests' tiny DeepSeek model), not by k3rocm's own plugin."""
    _fake_vllm(tmp_path, monkeypatch, UPSTREAM_LIKE)
    layers = tmp_path / "vllm" / "model_executor" / "layers"
    models = tmp_path / "vllm" / "model_executor" / "models"
    for d in (layers, models):
        d.mkdir(parents=True, exist_ok=True)
        (d / "__init__.py").write_text("")
    (tmp_path / "vllm" / "model_executor" / "__init__.py").write_text("")
    (layers / "mla.py").write_text("class MultiHeadLatentAttentionWrapper:\n    pass\n")
    (models / "deepseek_v2.py").write_text(
        "from vllm.model_executor.layers.mla import MultiHeadLatentAttentionWrapper\n")
    name = "vllm.model_executor.models.deepseek_v2"
    monkeypatch.setenv("K3_TEST_BIND_MODULES", name)
    monkeypatch.syspath_prepend(str(REPO / "tests" / "doubles"))
    import k3rocm_test_bind

    try:
        vllm_plugin.register()  # the product: the upstream hook only
        assert importlib.import_module(name).MultiHeadLatentAttentionWrapper.__name__ == \
            "MultiHeadLatentAttentionWrapper"
        _drop(name)
        k3rocm_test_bind.register()
        assert importlib.import_module(name).MultiHeadLatentAttentionWrapper.__name__ == \
            "KimiK3MultiHeadLatentAttentionWrapper"
        assert vllm_plugin._state["bound"] == [name]
    finally:
        _drop("vllm")
        sys.modules.pop("k3rocm_test_bind", None)
