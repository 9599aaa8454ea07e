"""TEST HELPER: real vLLM MLA layers on a CPU-only machine. The CPU platform refuses MLA in 0.27.x
and the auto prefill backend imports CUDA code, so (a) the CPU platform hands out vLLM's real
``TritonMLABackend`` where it would refuse, (b) MLAAttention gets a never-exercised prefill
backend. Everything else is the installed vLLM's own code.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import tempfile
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402

_SETUP: dict[str, Any] = {}
_counter = itertools.count()


def _patch_platform() -> None:
    from vllm.platforms import current_platform

    cls = type(current_platform)
    orig = cls.get_attn_backend_cls

    def get_attn_backend_cls(*args: Any, **kwargs: Any) -> str:
        try:
            path = orig(*args, **kwargs)
        except NotImplementedError:
            return "vllm.v1.attention.backends.mla.triton_mla.TritonMLABackend"
        # vLLM >= 0.32 on a CPU with AMX tiles picks AMX_MLA (platforms/cpu.py), whose packed
        # W_UK has no W_UK_T: the ROCm AITER backend's W_UK variant is the bf16 W_UK_T bmm,
        # which CPU_MLA keeps (AMX is a CPU-only variant; seen on an AMX machine here).
        if path.endswith("amx_mla.AMXMLABackend"):
            return "vllm.v1.attention.backends.mla.cpu_mla.CPUMLABackend"
        return path

    cls.get_attn_backend_cls = staticmethod(get_attn_backend_cls)  # type: ignore[assignment]

    import vllm.model_executor.layers.attention.mla_attention as ma
    from vllm.v1.attention.backends.mla.prefill.base import MLAPrefillBackend

    class UnusedPrefillBackend(MLAPrefillBackend):  # type: ignore[misc]
        @staticmethod
        def get_name() -> str:
            return "K3_TEST_UNUSED_PREFILL"

        def run_prefill_new_tokens(self, *a: Any, **k: Any):  # pragma: no cover
            raise NotImplementedError("prefill is not exercised in these CPU tests")

        def run_prefill_context_chunk(self, *a: Any, **k: Any):  # pragma: no cover
            raise NotImplementedError("prefill is not exercised in these CPU tests")

    orig_sel = ma.get_mla_prefill_backend

    def get_mla_prefill_backend(vllm_config: Any):
        try:
            return orig_sel(vllm_config)
        except Exception:  # noqa: BLE001 - CUDA-only prefill backends on CPU
            return UnusedPrefillBackend

    ma.get_mla_prefill_backend = get_mla_prefill_backend


@contextlib.contextmanager
def vllm_cpu_context():
    """Enter a VllmConfig context with a world-size-1 gloo group (idempotent)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if "patched" not in _SETUP:
        _patch_platform()
        _SETUP["patched"] = True
        _SETUP["config"] = VllmConfig()
    cfg = _SETUP["config"]
    with set_current_vllm_config(cfg):
        if not model_parallel_is_initialized():
            path = tempfile.mktemp(prefix="k3rocm-gloo-")
            init_distributed_environment(
                world_size=1, rank=0, local_rank=0,
                distributed_init_method=f"file://{path}", backend="gloo",
            )
            initialize_model_parallel(1, 1)
        yield cfg


def build_wrapper(cls: type, *, heads: int = 4, kv_lora_rank: int = 512, rope: int = 64,
                  cache_dtype: str = "fp8", seed: int = 0, load_weights: bool = True) -> Any:
    """Construct ``cls`` (a MultiHeadLatentAttentionWrapper) from real vLLM layers, shaped as
    Kimi-K3's attention (q LoRA, hidden 256 here); random weights from ``seed``."""
    from vllm.config import CacheConfig
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.mla import MLAModules

    hidden, q_lora_rank, nope, v_dim, dtype = 256, 128, 128, 128, torch.bfloat16
    prefix = f"model.layers.{next(_counter)}.self_attn"
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        mods = MLAModules(
            kv_a_layernorm=RMSNorm(kv_lora_rank, eps=1e-6),
            kv_b_proj=ColumnParallelLinear(kv_lora_rank, heads * (nope + v_dim), bias=False,
                                           prefix=f"{prefix}.kv_b_proj"),
            rotary_emb=None,
            o_proj=RowParallelLinear(heads * v_dim, hidden, bias=False,
                                     prefix=f"{prefix}.o_proj"),
            fused_qkv_a_proj=MergedColumnParallelLinear(
                hidden, [q_lora_rank, kv_lora_rank + rope], bias=False, disable_tp=True,
                prefix=f"{prefix}.fused_qkv_a_proj"),
            kv_a_proj_with_mqa=None,
            q_a_layernorm=RMSNorm(q_lora_rank, eps=1e-6),
            q_b_proj=ColumnParallelLinear(q_lora_rank, heads * (nope + rope), bias=False,
                                          prefix=f"{prefix}.q_b_proj"),
            q_proj=None,
            indexer=None,
            is_sparse=False,
            topk_indices_buffer=None,
        )
        wrapper = cls(
            hidden, heads, (nope + rope) ** -0.5, nope, rope, v_dim, q_lora_rank,
            kv_lora_rank, mods, CacheConfig(cache_dtype=cache_dtype), None, prefix,
        )
        if load_weights:
            gen = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for name, p in wrapper.named_parameters():
                    if name.endswith("layernorm.weight"):
                        p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
                    else:
                        p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
            # MLA first (it reads kv_b_proj's plain weight), then the CPU linears
            # (which may repack their weights).
            wrapper.mla_attn.process_weights_after_loading(dtype)
            for module in wrapper.modules():
                qm = getattr(module, "quant_method", None)
                if qm is not None and hasattr(qm, "process_weights_after_loading"):
                    qm.process_weights_after_loading(module)
    finally:
        torch.set_default_dtype(old)
    return wrapper


def decode_metadata(num_tokens: int, num_actual: int, slot_mapping: torch.Tensor,
                    prefills: int = 0, q_len: int = 1) -> Any:
    """Real vLLM MLACommonMetadata for a batch of ``num_actual`` tokens, of which ``prefills``
    are one-token prefill requests at the end (0 = decode-only)."""
    from vllm.model_executor.layers.attention.mla_attention import (
        MLACommonDecodeMetadata,
        MLACommonMetadata,
    )

    decode_tokens = num_actual - prefills
    decodes = decode_tokens // q_len
    starts = [i * q_len for i in range(decodes + 1)] + [
        decode_tokens + i + 1 for i in range(prefills)]
    return MLACommonMetadata(
        num_reqs=decodes + prefills,
        max_query_len=q_len,
        max_seq_len=64,
        num_actual_tokens=num_actual,
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        slot_mapping=slot_mapping,
        num_decodes=decodes,
        num_decode_tokens=decode_tokens,
        num_prefills=prefills,
        decode=MLACommonDecodeMetadata(
            block_table=torch.zeros((max(decodes, 1), 4), dtype=torch.int32),
            seq_lens=torch.full((max(decodes, 1),), 8, dtype=torch.int32),
            dcp_tot_seq_lens=None,
        ) if decodes else None,
    )


@contextlib.contextmanager
def forward_context(wrapper: Any, attn_metadata: Any, slot_mapping: torch.Tensor,
                    num_tokens: int):
    from vllm.forward_context import set_forward_context

    layer = wrapper.mla_attn.layer_name
    with set_forward_context(
        {layer: attn_metadata}, _SETUP["config"], num_tokens=num_tokens,
        slot_mapping={layer: slot_mapping},
    ):
        yield


def profile_forward(wrapper: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """One forward without attention metadata, as in vLLM's profile run (prefill scratch sized
    for the CPU): the stock branches run."""
    from vllm.forward_context import set_forward_context

    wrapper.mla_attn._chunked_prefill_workspace_size = 16
    n = hidden_states.shape[0]
    with set_forward_context(None, _SETUP["config"], num_tokens=n,
                             slot_mapping={wrapper.mla_attn.layer_name: torch.arange(n)}):
        return wrapper(torch.arange(n), hidden_states)


def load_overlay_module() -> Any:
    """Import the overlay's ``amd/mla.py`` as ``vllm.models.kimi_k3.amd.mla``."""
    import importlib
    import importlib.util
    import sys
    from pathlib import Path

    name = "vllm.models.kimi_k3.amd.mla"
    if name in sys.modules and getattr(sys.modules[name], "K3ROCM_OVERLAY", None):
        return sys.modules[name]
    repo_file = Path(__file__).resolve().parents[2] / "overlay/vllm/models/kimi_k3/amd/mla.py"
    pkg = importlib.import_module("vllm.models.kimi_k3.amd")
    installed = Path(pkg.__file__).parent / "mla.py"
    if installed.is_file() and (
        not repo_file.is_file() or installed.read_bytes() == repo_file.read_bytes()
    ) and b"K3ROCM_OVERLAY = 1" in installed.read_bytes():
        return importlib.import_module(name)  # the applied overlay (e.g. in our image)
    spec = importlib.util.spec_from_file_location(name, str(repo_file))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
