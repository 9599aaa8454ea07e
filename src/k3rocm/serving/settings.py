"""The ``K3_*`` settings schema (pydantic; a field carries its env name, help, default and range)
and the vendor variable prefixes the renderer passes to vLLM. A leaf of ``serving/``.
"""

from __future__ import annotations

import shlex
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator
from pydantic.fields import FieldInfo

from k3rocm.errors import one_line
from k3rocm.serving.fusions import FUSIONS
from k3rocm.serving.modelfacts import KIMI_K3_HEADS

PREFIX = "K3_"

# The union of vLLM's ``LoadFormats`` over the served releases
# (vllm@0.27.1:vllm/model_executor/model_loader/__init__.py:33 .. vllm@0.34.0:...:33; a test keeps
# it equal): vLLM takes any string (vllm@0.34.0:vllm/config/load.py:29) and fails only at load.
LoadFormat = Literal["auto", "bitsandbytes", "dummy", "fastsafetensors", "hf", "instanttensor",
                     "ipc_cache", "mistral", "modelexpress", "npcache", "pt", "runai_streamer",
                     "runai_streamer_sharded", "safetensors", "sharded_state", "tensorizer"]

# Vendor variables a user may set in the shell or .env: passed to the server, shown by make config.
VENDOR_PREFIXES = ("VLLM_", "AITER_", "NCCL_", "RCCL_", "HSA_", "HIP_", "ROCM_", "ROCR_",
                   "TRITON_", "TORCH_", "PYTORCH_", "MIOPEN_", "HF_", "HUGGING_FACE_",
                   "SAFETENSORS_", "TOKENIZERS_", "GLOO_", "MORI_", "UCX_", "OMP_")


def _env(name: str, help: str, group: str = "serving", default: Any = None, **kw: Any) -> Any:
    return Field(default, json_schema_extra={"env": PREFIX + name, "group": group},
                 description=help, **kw)


class _Serving(BaseModel):
    """The settings before the fusion switches (the README table's order)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    profile: str = _env(
        "PROFILE", "Serving profile: defaults for everything below and the vendor environment.",
        default="mi355x-tp8")
    model: str = _env(
        "MODEL", "A path inside the container (checkpoint under K3_MODELS_DIR, mounted at "
        "/models); it must exist. A Hugging Face id only with K3_ALLOW_HUB_DOWNLOAD=1.",
        default="/models/Kimi-K3")
    allow_hub_download: bool = _env(
        "ALLOW_HUB_DOWNLOAD", "Let K3_MODEL be a Hugging Face id that vLLM downloads into "
        "K3_CACHE_DIR at start (Kimi-K3: ~1.56 TB) (1/0).", default=False)
    served_model_name: str = _env(
        "SERVED_MODEL_NAME", "Model name clients use.", default="moonshotai/Kimi-K3")
    host: str = _env("HOST", "Address vLLM listens on inside the container.", default="0.0.0.0")
    port: int = _env("PORT", "Port vLLM listens on (and the published host port).",
                     default=8000, ge=1, le=65535)
    tp: int = _env("TP", f"Tensor parallel size; a positive divisor of Kimi-K3's {KIMI_K3_HEADS} "
                   "heads.", default=8)
    mtp_k: int = _env("MTP_K", "Speculative tokens per step (MTP); 0 turns speculation off.",
                      default=2, ge=0, le=16)
    mtp_method: Literal["mtp", "dspark", "eagle", "eagle3", "draft_model"] = _env(
        "MTP_METHOD", "Speculative method: mtp uses the model's own MTP head; "
        "dspark/eagle/eagle3/draft_model need K3_MTP_MODEL.", default="mtp")
    mtp_model: str | None = _env("MTP_MODEL", "Draft model for methods that need one.")
    mtp_attention_backend: str | None = _env(
        "MTP_ATTENTION_BACKEND", "Attention backend of the draft model (e.g. TRITON_MLA).")
    kv_cache_dtype: Literal["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_ds_mla"] = _env(
        "KV_CACHE_DTYPE", "KV cache dtype; the decode Q-prep fusion needs fp8.", default="fp8")
    max_model_len: int = _env("MAX_MODEL_LEN", "Maximum context length (tokens).",
                              default=262144, ge=128, le=1048576)
    gpu_memory_utilization: float | None = _env(
        "GPU_MEMORY_UTILIZATION", "Fraction of GPU memory vLLM may use (0 < x <= 1).",
        default=0.95, gt=0, le=1)
    max_num_seqs: int = _env("MAX_NUM_SEQS", "Maximum concurrent sequences.",
                             default=128, ge=1, le=4096)
    max_num_batched_tokens: int | None = _env(
        "MAX_NUM_BATCHED_TOKENS", "Token budget per engine step.", default=4096, ge=16,
        le=1048576)
    prefix_caching: bool = _env("PREFIX_CACHING", "Automatic prefix caching (1/0).", default=True)
    enforce_eager: bool = _env("ENFORCE_EAGER", "Disable CUDA/HIP graphs (1/0).", default=False)
    load_format: LoadFormat = _env(
        "LOAD_FORMAT", "Weight loader: one of vLLM's load formats (0.27.1 ... 0.34.0; case "
        "ignored, as vLLM does), e.g. auto, safetensors, fastsafetensors.", default="auto")
    trust_remote_code: bool = _env("TRUST_REMOTE_CODE", "Pass --trust-remote-code (1/0).",
                                   default=True)
    language_model_only: bool = _env(
        "LANGUAGE_MODEL_ONLY", "Skip the vision tower (--language-model-only) (1/0).", default=True)
    moe_backend: str | None = _env("MOE_BACKEND", "MoE backend (--moe-backend).", default="auto")
    reasoning_parser: str | None = _env("REASONING_PARSER", "Reasoning parser.", default="kimi_k3")
    tool_call_parser: str | None = _env(
        "TOOL_CALL_PARSER", "Tool-call parser (enables auto tool choice).", default="kimi_k3")
    api_key: str | None = _env("API_KEY", "API key clients must send (given to vLLM as "
                               "VLLM_API_KEY, never in argv; redacted in printouts).")
    extra_args: str = _env("EXTRA_ARGS", "Extra `vllm serve` arguments, shell-quoted, appended "
                           "last (after argv from the entrypoint); a flag a K3_* setting "
                           "renders (e.g. --max-model-len, -tp) is refused: set the setting.",
                           default="")

    @field_validator("tp")
    @classmethod
    def _tp_divides_heads(cls, v: int) -> int:
        if v < 1 or KIMI_K3_HEADS % v:
            divisors = [d for d in range(1, KIMI_K3_HEADS + 1) if KIMI_K3_HEADS % d == 0]
            raise ValueError(f"must be a positive divisor of {KIMI_K3_HEADS} heads: "
                             f"one of {', '.join(map(str, divisors))}")
        return v

    @field_validator("load_format", mode="before")
    @classmethod
    def _load_format_lower(cls, v: Any) -> Any:
        return v.lower() if isinstance(v, str) else v

    @field_validator("extra_args")
    @classmethod
    def _extra_args_parse(cls, v: str) -> str:
        try:
            shlex.split(v)
        except ValueError as exc:
            raise ValueError(f"is not valid shell quoting ({exc})") from None
        return v


# One switch per fusion table row, between the serving settings and the rest.
_Fusions = create_model("_Fusions", __base__=_Serving, **{
    f.field: (bool, _env(f.env.removeprefix(PREFIX), f.doc, "overlay", default=f.default))
    for f in FUSIONS})


class Settings(_Fusions):
    """Every K3_* setting. Field order is the order of the README table."""

    base_check: Literal["enforce", "warn"] = _env(
        "BASE_CHECK", "What the serving image's base facts (vLLM, AITER, the decode route at "
        "the heads per rank) do to a setting it cannot run: enforce (exit 2 before the load) "
        "or warn.", "overlay", default="enforce")
    overlay: Literal["auto", "force", "off"] = _env(
        "OVERLAY", "Overlay mode: auto (skip if vLLM ships amd/mla.py), force, off. A build arg "
        "for the image and a run-time switch for the wiring.", "overlay", default="auto")
    profiler_dir: str | None = _env(
        "PROFILER_DIR", "When set, the torch profiler writes gzip traces here "
        "(POST /start_profile, /stop_profile).", "profiling")
    profiler_max_iterations: int = _env("PROFILER_MAX_ITERATIONS",
                                        "Engine steps the profiler records (0 = until stopped).",
                                        "profiling", default=6, ge=0)
    profiler_delay_iterations: int = _env("PROFILER_DELAY_ITERATIONS",
                                          "Engine steps to skip after /start_profile.",
                                          "profiling", default=0, ge=0)
    profiler_style: Literal["config", "env"] = _env(
        "PROFILER_STYLE", "How to configure the profiler: --profiler-config (vLLM >= 0.27) or "
        "VLLM_TORCH_PROFILER_DIR (older builds).", "profiling", default="config")
    models_dir: str = _env("MODELS_DIR", "Host directory mounted read-only at /models.",
                           "deployment", default="./models")
    cache_dir: str = _env("CACHE_DIR", "Host directory for the HF, vLLM and AITER caches.",
                          "deployment", default="./cache")
    results_dir: str = _env("RESULTS_DIR", "Host directory for results (mounted at /results).",
                            "deployment", default="./results")
    bind_address: str = _env("BIND_ADDRESS", "Host address the port is published on.",
                             "deployment", default="127.0.0.1")
    image: str = _env("IMAGE", "Tag of the serving image compose builds and runs.", "deployment",
                      default="k3rocm/server:latest")


FIELDS = Settings.model_fields
ENV_NAME = {name: f.json_schema_extra["env"] for name, f in FIELDS.items()}  # type: ignore[index]
FIELD_BY_ENV = {env: name for name, env in ENV_NAME.items()}


def invalid(exc: ValidationError, values: dict[str, Any], model: type[BaseModel] | None = None,
            env: dict[str, str] | None = None) -> str:
    """The first error of validating ``values`` as one line: ``K3_X=value is not valid: ...``
    (for a type or range error, what to use)."""
    def what(kind: str, err: dict[str, Any]) -> str | None:
        f = (model or Settings).model_fields[err["loc"][0]]
        return (f"is not valid: use {_describe_valid(f)}"
                if kind in ("range", "literal_error") or "parsing" in kind else None)
    named = env or ENV_NAME  # a field's error has a loc (no model validators here)
    return one_line(exc, lambda loc, _: f"{named.get(loc[0], loc[0])}={values.get(loc[0], '?')!r}",
                    what)


def _describe_valid(f: FieldInfo) -> str:
    ann = f.annotation
    args = getattr(ann, "__args__", ())
    if ann is bool:
        return "1 or 0"
    if args and all(isinstance(a, str) for a in args):
        return "one of " + ", ".join(args)
    bounds = [f"{sym} {getattr(m, attr)}" for m in f.metadata for attr, sym in
              (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
              if getattr(m, attr, None) is not None]
    kind = "text" if str in (ann, *args) else "an integer" if int in (ann, *args) else "a number"
    return kind + (" " + " and ".join(bounds) if bounds else "")
