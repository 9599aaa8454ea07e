"""TEST DOUBLE hook for live stand-in servers (this directory on PYTHONPATH, k3rocm installed).

With ``K3_TEST_DOUBLE_ROCM=1`` (or ``=platform``, which also makes
``current_platform.is_rocm()`` answer True to the overlay: for one-shot processes such as
``k3rocm overlay probe``, never for a serving process) every Python process (API
server, engine core, workers) applies ``rocm_vllm.activate()`` right after vLLM imports
``vllm._aiter_ops``, i.e. where vLLM on ROCm registers its AITER ops (through the plugin's own
post-import hook, ``k3rocm.serving.vllm_plugin.after_import``). The platform stays CPU (vLLM
must keep serving on CPU), so the overlay's Q-prep gate still reads "platform is not ROCm".
Never mounted into a serving image.
"""

import os

MODE = os.environ.get("K3_TEST_DOUBLE_ROCM")


def _activate(module) -> None:
    import rocm_vllm

    rocm_vllm.activate(platform=MODE == "platform")


if MODE in ("1", "platform"):
    from k3rocm.serving.vllm_plugin import after_import

    after_import({"vllm._aiter_ops": _activate})
