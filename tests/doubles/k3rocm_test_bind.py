"""TEST DOUBLE (CPU stand-in only): a vLLM general plugin that rebinds the MLA wrapper name of
more model modules, as k3rocm's own plugin does for Kimi-K3's ``amd/linear.py``.

``K3_TEST_BIND_MODULES=<module>[,<module>...]`` (e.g. ``vllm.model_executor.models.deepseek_v2``
for the end-to-end tests with a tiny random DeepSeek-V3 checkpoint): right after each module is
imported, its ``MultiHeadLatentAttentionWrapper`` becomes the Kimi-K3 class of ``amd/mla.py``
(the overlay's, or on an upstream base upstream's, which k3rocm's plugin hooks), through
``k3rocm.serving.vllm_plugin.bind``. Like k3rocm's plugin it does nothing with
``K3_OVERLAY=off`` or without an ``amd/mla.py``; without the variable it does nothing.

How it gets in: this directory on PYTHONPATH (the stand-in tests' ``D=PYTHONPATH=...``, the
census test image's ``ENV PYTHONPATH``); the ``.dist-info`` beside this file registers
:func:`register` in the entry point group ``vllm.general_plugins``, which vLLM loads in every
process before it builds a model, as tests/doubles/stepdelay. Never in the serving image.
"""

import os

ENV = "K3_TEST_BIND_MODULES"


def register() -> None:
    modules = [n for n in map(str.strip, os.environ.get(ENV, "").split(",")) if n]
    if not modules or os.environ.get("K3_OVERLAY", "").strip().lower() == "off":
        return
    from k3rocm.serving import vllm_plugin

    if vllm_plugin.amd_mla_text() is not None:
        vllm_plugin.after_import(dict.fromkeys(modules, vllm_plugin.bind))
