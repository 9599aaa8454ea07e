"""The plugin's post-import hook without vLLM (the real wiring: test_overlay_image.py)."""

from __future__ import annotations

import importlib
import runpy
import sys

import pytest
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


AMD = "vllm/models/kimi_k3/amd/"
UPSTREAM_LIKE = """
class KimiK3MultiHeadLatentAttentionWrapper:
    def __init__(self):
        self._use_eager_qk_rmsnorm_fusion = True
        self.mla_attn = None
"""


def _drop(prefix):
    for name in [m for m in sys.modules if m == prefix or m.startswith(prefix + ".")]:
        sys.modules.pop(name, None)


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """fake_vllm(files): a ``vllm`` package with Kimi-K3's amd/ and ``files`` (path -> text),
    every directory a package; the plugin's state fresh, K3_OVERLAY unset."""
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.setattr(vllm_plugin, "_state", {"registered": False, "bound": [],
                                                "upstream_hook": False})
    monkeypatch.delenv("K3_OVERLAY", raising=False)

    def make(files: dict[str, str]) -> None:
        for rel, text in {AMD + "__init__.py": "", **files}.items():
            (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / rel).write_text(text)
        for d in (tmp_path / "vllm").rglob("*"):
            if d.is_dir() and not (d / "__init__.py").exists():
                (d / "__init__.py").write_text("")
        (tmp_path / "vllm" / "__init__.py").touch()
        monkeypatch.syspath_prepend(str(tmp_path))

    yield make
    _drop("vllm")


def test_upstream_amd_mla_gets_the_hook(fake_vllm, monkeypatch):
    """On a base whose amd/mla.py is upstream's, register() hooks that module (and only on
    import: nothing of Kimi-K3 is imported by the plugin itself)."""
    fake_vllm({AMD + "mla.py": UPSTREAM_LIKE})
    monkeypatch.setenv("K3_FUSE_QK_NORM", "0")
    vllm_plugin.register()
    assert vllm_plugin._state["upstream_hook"] is True
    assert "vllm.models.kimi_k3.amd.mla" not in sys.modules
    mod = importlib.import_module("vllm.models.kimi_k3.amd.mla")
    layer = mod.KimiK3MultiHeadLatentAttentionWrapper()
    assert layer._use_eager_qk_rmsnorm_fusion is False


@pytest.mark.parametrize("mla,overlay", [(vllm_plugin.MARKER + "\n", None), (None, None),
                                         (UPSTREAM_LIKE, "off")],
                         ids=["the-overlay", "no-amd-mla", "k3-overlay-off"])
def test_no_hook_on_the_overlay_without_amd_mla_or_with_k3_overlay_off(mla, overlay, fake_vllm,
                                                                       monkeypatch):
    fake_vllm({AMD + "mla.py": mla} if mla else {})
    if overlay:
        monkeypatch.setenv("K3_OVERLAY", overlay)
    vllm_plugin.register()
    assert vllm_plugin._state["upstream_hook"] is False


def test_the_bind_double_rebinds_a_named_model_and_the_product_does_not(fake_vllm, monkeypatch):
    """K3_TEST_BIND_MODULES is read by the test-only plugin tests/doubles/k3rocm_test_bind.py
    (the CPU end-to-end tests' tiny DeepSeek model), not by k3rocm's own plugin."""
    fake_vllm({AMD + "mla.py": UPSTREAM_LIKE,
               "vllm/model_executor/layers/mla.py":
                   "class MultiHeadLatentAttentionWrapper:\n    pass\n",
               "vllm/model_executor/models/deepseek_v2.py":
                   "from vllm.model_executor.layers.mla import MultiHeadLatentAttentionWrapper\n"})
    name = "vllm.model_executor.models.deepseek_v2"
    monkeypatch.setenv("K3_TEST_BIND_MODULES", name)
    vllm_plugin.register()  # the product: the upstream hook only
    assert importlib.import_module(name).MultiHeadLatentAttentionWrapper.__name__ == \
        "MultiHeadLatentAttentionWrapper"
    _drop(name)
    runpy.run_path(str(REPO / "tests" / "doubles" / "k3rocm_test_bind.py"))["register"]()
    assert importlib.import_module(name).MultiHeadLatentAttentionWrapper.__name__ == \
        "KimiK3MultiHeadLatentAttentionWrapper"
    assert vllm_plugin._state["bound"] == [name]
