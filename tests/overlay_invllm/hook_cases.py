"""The upstream hook inside REAL vLLM (driven by test_overlay_standin.py in the 0.32.0 CPU
stand-in, k3rocm installed): ``python3 hook_cases.py VERSION`` prints one ``CASE {json}`` line
per case. VERSION's real amd/mla.py is vLLM's (0.33.0/0.34.0 mounted over the stand-in's; the
names 0.32 lacks come from a recording double below). ``K3_TEST_DOUBLE_ROCM=1`` with
tests/doubles on PYTHONPATH makes this vLLM answer like ROCm + AITER.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import types
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

NORM = "aiter::fused_qk_rmsnorm_kernel"
VERSION = sys.argv[1]
REFILLED: list[str] = []


def supply_missing_names() -> None:
    """TEST DOUBLE for the names a 0.33/0.34 amd/mla.py imports that vLLM 0.32 lacks."""
    import vllm.model_executor.utils as u

    if not hasattr(u, "refill_derived"):
        def refill_derived(module, name, value):  # records, then sets (what its name says)
            REFILLED.append(name)
            setattr(module, name, value)

        u.refill_derived = refill_derived
    name = "vllm.v1.attention.backends.mla.rocm_aiter_mla"
    try:
        __import__(name)
    except Exception:  # noqa: BLE001 - imports AITER's GPU code: give the one helper it needs
        mod = types.ModuleType(name)
        mod.AiterMLAHelper = type("AiterMLAHelper", (), {
            "get_actual_mla_num_heads": staticmethod(lambda n: max(n, 16))})
        sys.modules[name] = mod


def main() -> None:
    supply_missing_names()
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # vLLM's own loader -> k3rocm's entry point -> register()
    from k3rocm.serving import decisions, upstream_hook, vllm_plugin

    warnings: list[str] = []
    logged: list[dict] = []

    class Catch(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())
            rec = decisions.parse_line(record.getMessage())
            if rec:
                logged.append(rec)

    logging.getLogger("vllm.k3rocm").addHandler(Catch())
    # vLLM 0.32 configures its logger when an engine or `vllm serve` starts
    # (configure_logging_if_needed: logger "vllm" at INFO); no engine runs here
    logging.getLogger("vllm").setLevel(logging.INFO)
    import aiter  # the AITER double (counts launches)
    import mla_cpu
    import vllm.models.kimi_k3.amd.mla as m

    upstream = m.KimiK3MultiHeadLatentAttentionWrapper
    out: dict = {"vllm_file_version": VERSION, "file": m.__file__,
                 "hook_state": vllm_plugin._state["upstream_hook"],
                 "init_wrapped": getattr(upstream.__init__, "_k3rocm_upstream_hook", False)}

    def build(cls, env: dict) -> tuple:
        """The layer, and the decision records its construction wrote."""
        for k in ("K3_FUSE_QK_NORM", "K3_FUSE_DECODE_QPREP"):
            os.environ.pop(k, None)
        os.environ.update(env)
        n = len(upstream_hook.WRITER.records)
        w = mla_cpu.build_wrapper(cls, heads=4, seed=3, cache_dtype="auto")
        return w, upstream_hook.WRITER.records[n:]

    def norm_calls_in_forward(w) -> int:
        before = aiter.calls[NORM]
        mla_cpu.profile_forward(w, torch.randn(2, 256).to(torch.bfloat16))
        return aiter.calls[NORM] - before

    def summary(w) -> dict:
        return {k: (v if isinstance(v, bool) or v is None else type(v).__name__)
                for k in ("_use_eager_qk_rmsnorm_fusion", "_fused_qk_prep", "_fold_qb_uk",
                          "_zero_positions", "_w_fold")
                if (v := getattr(w, k, "absent")) != "absent"}

    class QprepOn(upstream):  # the test forces upstream's Q-prep gate to say yes (CPU: no)
        def _fused_qk_prep_supported(self):
            return True

    class OddNorm(upstream):  # a base whose norm attribute is not a bool
        @property
        def _use_eager_qk_rmsnorm_fusion(self):
            return self.__dict__.get("_odd")

        @_use_eager_qk_rmsnorm_fusion.setter
        def _use_eager_qk_rmsnorm_fusion(self, value):
            self.__dict__["_odd"] = 1 if value else 0

    cases = [("qk_on", upstream, {"K3_FUSE_QK_NORM": "1"}),
             ("qk_off", upstream, {"K3_FUSE_QK_NORM": "0"}),
             ("qprep_forced_on", QprepOn, {"K3_FUSE_DECODE_QPREP": "1"}),
             ("qprep_forced_off", QprepOn, {"K3_FUSE_DECODE_QPREP": "0"}),
             ("odd_norm_asked_off", OddNorm, {"K3_FUSE_QK_NORM": "0"})]
    with mla_cpu.vllm_cpu_context():
        for name, cls, env in cases:
            warned = len(warnings)
            w, recs = build(cls, env)
            case = {"case": name, "env": env, "attrs": summary(w), "records": recs,
                    "warnings": len(warnings) - warned}
            if name.startswith("qprep"):
                REFILLED.clear()
                if hasattr(w, "process_weights_after_loading"):
                    try:
                        w.process_weights_after_loading()  # upstream's own (0.34: the fold)
                        case["refilled"] = list(REFILLED)
                    except Exception as exc:  # noqa: BLE001 - 0.32 API under a 0.34 file
                        case["refilled"] = f"error {type(exc).__name__}: {exc}"
                case["attrs_after_load"] = summary(w)
            else:
                case["fused_norm_calls_in_forward"] = norm_calls_in_forward(w)
            print("CASE " + json.dumps(case, default=str), flush=True)
    d = os.environ.get("K3_PROFILER_DIR")
    files = sorted(p.name for p in Path(d).iterdir()) if d else []
    on_disk = (decisions.records_from_files([Path(d) / f for f in files]) if files else [])
    print("CASE " + json.dumps({"case": "summary", **out, "warnings": warnings,
                                "files": files,
                                "file_equals_log": [r.raw for r in on_disk] == logged
                                == upstream_hook.WRITER.records}), flush=True)


if __name__ == "__main__":
    main()
