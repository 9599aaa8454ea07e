"""Which launches play which role, per platform, and what else a model launches of them.

A *role* is a set of kernel/operator names (regular expressions over normalized names):

- ``fused_qk_norm``: the one-launch q/kv RMSNorm (AITER ``fused_qk_rmsnorm``; on CPU the
  ``vllm::fused_mla_dual_rms_norm`` operator when a reference implementation is registered).
- ``qk_norm``: separate RMSNorm launches. The MLA q/kv norms are two of these per MLA layer
  when the fusion is off; the model's other RMSNorm launches of the same kind per step come
  from ``MODEL_FAMILIES`` (a formula over the model config) so the q/kv share can be isolated.
- ``fused_qprep``: AITER ``fused_qk_rope_concat_and_cache_mla``.
- ``cache_write``: the stock MLA KV-cache write (``concat_and_cache_mla``; on the CPU build of
  vLLM 0.32 the ``vllm::unified_mla_kv_cache_update`` operator that performs it).
- ``q_concat_quant``: the ``[ql_nope | q_pe]`` concat and its fp8 quant inside the MLA
  attention operator (the other launches the decode fusion removes). Generic kernels, so only
  those launched inside the MLA attention operator count (``require_parents``); reported and
  part of the A/B's Q-prep group, never checked.

A launch counts for a role only when none of the operators it is nested in also matches that
role (so ``_C::rms_norm`` and the ``aten::rsqrt`` inside it count once), and not when a
parent matches ``exclude_parents`` (the rsqrt inside the fused reference op is not a separate
norm). Everything here can be overridden with ``--spec FILE`` (JSON with the same shape).
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3rocm.errors import UsageError

ROLES = ("fused_qk_norm", "qk_norm", "fused_qprep", "cache_write", "q_concat_quant")

PLATFORMS: dict[str, dict[str, dict[str, list[str]]]] = {
    # Device kernels on ROCm (AITER / vLLM _C). Names are matched after normalization
    # (template arguments and argument lists stripped).
    "rocm": {
        "fused_qk_norm": {"match": [r"fused_qk_rmsnorm"]},
        "qk_norm": {
            "match": [r"(?i)rms_?norm"],
            # residual-add, gated, quantizing variants and the fused dual norm are other kernels
            "exclude": [r"(?i)fused_qk_rmsnorm", r"(?i)add", r"(?i)gated", r"(?i)quant"],
        },
        "fused_qprep": {"match": [r"fused_qk_rope_concat_and_cache_mla"]},
        "cache_write": {"match": [r"(^|::)concat_and_cache_mla(_kernel)?$"]},
        "q_concat_quant": {
            "match": [r"CatArrayBatchedCopy", r"(?i)scaled_fp8_quant", r"(?i)fp8.*quant"],
            "require_parents": [r"mla_attention"],
        },
    },
    # CPU operators (cpu_op events) of the CPU build of vLLM: the stand-in has no GPU kernels.
    "cpu": {
        "fused_qk_norm": {"match": [r"fused_mla_dual_rms_norm"]},
        "qk_norm": {
            # vLLM's native RMSNorm runs as aten ops with exactly one rsqrt per norm; a C++
            # build uses _C::rms_norm / _C::fused_add_rms_norm. One count per norm either way.
            "match": [r"^aten::rsqrt$", r"^_C::(fused_add_)?rms_norm$"],
            "exclude_parents": [r"fused_mla_dual_rms_norm", r"fused_qk_rmsnorm"],
        },
        "fused_qprep": {"match": [r"fused_qk_rope_concat_and_cache_mla"]},
        "cache_write": {
            "match": [r"^vllm::unified_mla_kv_cache_update$",
                      r"(^|::)concat_and_cache_mla(_kernel)?$"],
        },
        "q_concat_quant": {
            "match": [r"^aten::cat$", r"(?i)scaled_fp8_quant"],
            "require_parents": [r"mla_attention"],
        },
    },
}

# Per model family: how many launches of the ``qk_norm`` role per engine step are *not* the
# MLA q/kv norms, as a formula over: layers, mla_layers. None = not known for that platform
# (the separate-norm row is then reported, not checked; census-ab still shows the difference).
MODEL_FAMILIES: dict[str, dict[str, str | None]] = {
    # DeepSeek-V2/V3 decoder: input + post-attention norm per layer, one final norm. On CPU all
    # are native RMSNorms; on ROCm all but the first layer's input norm are residual-add kernels.
    "deepseek": {"cpu": "2*layers + 1", "rocm": "1"},
    # Kimi-K3 (kimi_linear text model): attention-residual and latent-MoE norms whose kernels
    # were not observed on hardware yet.
    "kimi_linear": {"cpu": None, "rocm": None},
}
FAMILY_OF_MODEL_TYPE = {
    "deepseek_v2": "deepseek", "deepseek_v3": "deepseek", "deepseek_v32": "deepseek",
    "kimi_k2": "deepseek", "kimi_linear": "kimi_linear", "kimi_k3": "kimi_linear",
}


@dataclass
class Role:
    name: str
    match: list[re.Pattern[str]]
    exclude: list[re.Pattern[str]]
    exclude_parents: list[re.Pattern[str]]
    require_parents: list[re.Pattern[str]]

    def hits(self, name: str) -> bool:
        return any(p.search(name) for p in self.match) and not any(
            p.search(name) for p in self.exclude)

    def counts(self, name: str, parents: tuple[str, ...], outermost: bool = True) -> bool:
        """``outermost``: CPU operators nest (``_C::rms_norm`` > ``aten::rsqrt``), so only the
        outermost match counts; GPU kernels have operators as parents, not other kernels."""
        if not self.hits(name):
            return False
        if self.require_parents and not any(
                x.search(p) for p in parents for x in self.require_parents):
            return False
        return not any((outermost and self.hits(p))
                       or any(x.search(p) for x in self.exclude_parents) for p in parents)


@dataclass
class Spec:
    platform: str
    roles: dict[str, Role]
    other_norms_formula: str | None
    family: str | None
    source: dict[str, Any]


def _compile(lst: Any, where: str) -> list[re.Pattern[str]]:
    if not isinstance(lst, list) or not all(isinstance(x, str) for x in lst):
        raise UsageError(f"census spec {where} must be a list of regex strings, got {lst!r}")
    out = []
    for p in lst:
        try:
            out.append(re.compile(p))
        except re.error as exc:
            raise UsageError(f"census spec {where}: {p!r} is not a valid regex ({exc})") from None
    return out


def load_spec(platform: str, model_type: str | None, spec_file: str | None = None,
              other_norms: str | None = None) -> Spec:
    """Build the role matchers for ``platform`` (rocm|cpu), optionally overridden by a JSON
    file ``{"platforms": {...}, "model_families": {...}, "family_of_model_type": {...}}``."""
    platforms = copy.deepcopy(PLATFORMS)
    families = copy.deepcopy(MODEL_FAMILIES)
    fam_of = dict(FAMILY_OF_MODEL_TYPE)
    if spec_file:
        try:
            user = json.loads(Path(spec_file).read_text())
        except (OSError, ValueError) as exc:
            raise UsageError(f"--spec {spec_file} cannot be read as JSON ({exc})") from None
        if not isinstance(user, dict):
            raise UsageError(f"--spec {spec_file} must hold a JSON object")
        for plat, roles in (user.get("platforms") or {}).items():
            platforms.setdefault(plat, {}).update(roles)
        families.update(user.get("model_families") or {})
        fam_of.update(user.get("family_of_model_type") or {})
    if platform not in platforms:
        raise UsageError(f"platform {platform!r} is not known; valid: "
                         f"{', '.join(sorted(platforms))}")
    roles = {}
    for rname in ROLES:
        r = platforms[platform].get(rname)
        if not isinstance(r, dict):
            raise UsageError(f"census spec: platform {platform!r} has no role {rname!r}")
        where = f"{platform}.{rname}"
        roles[rname] = Role(rname, _compile(r.get("match", []), where + ".match"),
                            _compile(r.get("exclude", []), where + ".exclude"),
                            _compile(r.get("exclude_parents", []), where + ".exclude_parents"),
                            _compile(r.get("require_parents", []), where + ".require_parents"))
    family = fam_of.get(model_type or "")
    formula = families.get(family, {}).get(platform) if family else None
    if other_norms is not None:
        formula = other_norms
    return Spec(platform, roles, formula, family,
                {"platform": platform, "roles": platforms[platform], "family": family,
                 "other_norms_per_step": formula, "spec_file": spec_file})


_FORMULA_OK = re.compile(r"^[\s\d+\-*()a-z_]*$")


def eval_formula(formula: str, variables: dict[str, int]) -> int:
    """Evaluate a tiny integer formula such as ``2*layers + 1`` (names, digits, + - * ())."""
    if not _FORMULA_OK.match(formula):
        raise UsageError(f"formula {formula!r} may only use integers, + - * ( ) and "
                         f"{', '.join(sorted(variables))}")
    names = set(re.findall(r"[a-z_]+", formula))
    unknown = names - set(variables)
    if unknown:
        raise UsageError(f"formula {formula!r} uses unknown name(s) {sorted(unknown)}; "
                         f"valid: {', '.join(sorted(variables))}")
    try:
        value = eval(formula, {"__builtins__": {}}, dict(variables))  # noqa: S307 - checked
    except Exception as exc:  # noqa: BLE001
        raise UsageError(f"formula {formula!r} cannot be evaluated ({exc})") from None
    return int(value)
