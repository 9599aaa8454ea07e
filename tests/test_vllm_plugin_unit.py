"""The plugin's post-import hook without vLLM: a module named in the finder is bound right after
it executes (its globals exist by then), once, and other imports pass through untouched. The
real wiring inside vLLM is tests/overlay_invllm/check_overlay_wrapper.py (Docker)."""

from __future__ import annotations

import importlib
import sys

from k3rocm.serving import vllm_plugin


def test_finder_binds_the_named_module_after_it_runs(tmp_path, monkeypatch):
    pkg = tmp_path / "k3fakepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "linear.py").write_text("MultiHeadLatentAttentionWrapper = 'base'\n")
    (pkg / "other.py").write_text("X = 1\n")
    seen = []
    monkeypatch.setattr(vllm_plugin, "bind", lambda m: seen.append(
        (m.__name__, m.MultiHeadLatentAttentionWrapper)))
    monkeypatch.syspath_prepend(str(tmp_path))
    finder = vllm_plugin._Finder({"k3fakepkg.linear"})
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    try:
        importlib.import_module("k3fakepkg.other")
        assert seen == []
        importlib.import_module("k3fakepkg.linear")
        importlib.import_module("k3fakepkg.linear")  # cached: not executed, not bound again
        assert seen == [("k3fakepkg.linear", "base")]
        assert finder.names == {"k3fakepkg.linear"}
    finally:
        for name in ("k3fakepkg", "k3fakepkg.linear", "k3fakepkg.other"):
            sys.modules.pop(name, None)
