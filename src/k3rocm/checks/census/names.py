"""Kernel / operator name normalization.

A census counts launches per *kernel*, not per instantiation or per name form, so every form a
chrome trace carries for one kernel normalizes to one name:

- CUDA (kineto CUPTI, ``libkineto/src/output_json.cpp`` writes the demangled name):
  ``void vllm::rms_norm_kernel<c10::BFloat16, 8>(c10::BFloat16*, ...)``;
- ROCm roctracer (kineto ``RoctracerActivity``; the demangled HIP kernel name, same shape):
  ``void aiter::fused_qk_rmsnorm_kernel<__hip_bfloat16, 256, 8, true, 1>(...)``;
- ROCm rocprofiler-sdk (kineto's ROCm backend in 2026, ``RocprofActivity``): the code-object
  kernel *symbol*, demangled: ``void aiter::fused_qk_rmsnorm_kernel<...>(...) [clone .kd]``;
  symbols that do not demangle (Triton, assembly kernels) end in ``.kd``:
  ``triton_poi_fused__to_copy_cat_clamp_mul_reciprocal_view_0.kd``.

The normalizer drops a `` [clone ...]`` suffix and a trailing ``.kd``, cuts at the first
top-level ``(`` (the argument list; a ``(`` inside template arguments such as
``(vllm::Fp8KVCacheDataType)1`` is not top level, ``(anonymous namespace)::`` is removed first),
drops the return type and the template arguments. Generic launcher names (CK-tile's
``ck_tile::kentry<...>``) would all collapse into one bucket, so for those the first
kernel-like type inside the template arguments is kept: ``ck_tile::kentry<Rmsnorm2dFwd>``.
After that, user aliases (``regex -> name``, first match wins) rename whatever is left.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from k3rocm.errors import UsageError

# Launcher names whose template arguments are the only thing that tells kernels apart.
DEFAULT_GENERIC = (r"^ck_tile::kentry$", r"^ck::kernel_\w+$", r"^kernel$", r"^kernel_func$")
_KERNELISH = re.compile(r"[A-Za-z_][\w:]*(?:Kernel|Fwd|Bwd|Pipeline|kernel)\w*")


def _split_outer(name: str) -> tuple[str, str]:
    """Return (name without template args, text of the first top-level template arg list)."""
    out: list[str] = []
    first: list[str] = []  # nested "<" kept, every ">" left out
    depth, seen = 0, False  # seen: the first template list has closed
    for ch in name:
        if ch == ">" and depth:
            depth -= 1
            seen = seen or not depth
        elif ch == "<":
            depth += 1
            if depth > 1 and not seen:
                first.append(ch)
        elif not depth:
            out.append(ch)
        elif not seen:
            first.append(ch)
    return "".join(out), "".join(first)


# the code-object suffixes rocprofiler-sdk names carry: `` [clone .kd]`` (any ``[clone ...]``,
# possibly repeated) and a trailing ``.kd``
_SUFFIXES = re.compile(r"(?:\s*\[clone [^\]]*\]|\.kd)+$")


_LENGTH = re.compile(r"\d+")


def _demangle_qualified(name: str) -> str:
    """``_ZN5aiter23fused_qk_rmsnorm_kernelI...`` -> ``aiter::fused_qk_rmsnorm_kernel``: the
    qualified name of an Itanium-mangled symbol (what rocprofiler-sdk's kernel symbol holds
    before kineto demangles it; kept when demangling fails). Templates/arguments are dropped."""
    if not name.startswith("_Z"):
        return name
    nested = name.startswith("_ZN")
    i = 3 if nested else 2
    parts = []
    while m := _LENGTH.match(name, i):  # <length><identifier>, ...
        i = m.end() + int(m.group())
        parts.append(name[m.end():i])
        if not nested:
            break
    return "::".join(parts) if parts and all(parts) else name


def _strip_args(name: str) -> str:
    """Cut at the first top-level ``(`` (outside ``<...>``): the argument list and anything
    after it. ``(anonymous namespace)::`` is removed first; ``operator()`` keeps its name."""
    name = name.replace("(anonymous namespace)::", "")
    depth = 0
    for i, ch in enumerate(name):
        if ch == "<":
            depth += 1
        elif ch == ">" and depth > 0:
            depth -= 1
        elif ch == "(" and depth == 0:
            head = name[:i].rstrip()
            if head.endswith("operator"):  # operator()(...): cut at the second "("
                j = name.find("(", i + 2)
                return name[:j].rstrip() if j > 0 else name
            return head or name
    return name


@dataclass
class Normalizer:
    """Configurable kernel-name normalizer (``strip_templates`` off keeps names verbatim)."""

    strip_templates: bool = True
    aliases: list[tuple[re.Pattern[str], str]] = field(default_factory=list)
    generic: list[re.Pattern[str]] = field(
        default_factory=lambda: [re.compile(p) for p in DEFAULT_GENERIC])
    _cache: dict[str, str] = field(default_factory=dict, repr=False)

    @classmethod
    def from_specs(cls, aliases: Iterable[str] = (), strip_templates: bool = True) -> Normalizer:
        """``aliases``: ``REGEX=NAME`` strings (applied to the normalized name, first wins)."""
        pairs: list[tuple[re.Pattern[str], str]] = []
        for spec in aliases:
            if "=" not in spec:
                raise UsageError(f"kernel alias {spec!r} is not REGEX=NAME "
                                 "(e.g. 'rms_norm_kernel$=rms_norm')")
            pat, _, new = spec.rpartition("=")
            try:
                pairs.append((re.compile(pat), new))
            except re.error as exc:
                raise UsageError(f"kernel alias {pat!r} is not a valid regular expression "
                                 f"({exc})") from None
        return cls(strip_templates=strip_templates, aliases=pairs)

    def __call__(self, raw: str) -> str:
        hit = self._cache.get(raw)
        if hit is not None:
            return hit
        name = _SUFFIXES.sub("", " ".join(raw.split()))
        if self.strip_templates:
            name = _strip_args(_demangle_qualified(name)).removeprefix("void ")
            base, tmpl = _split_outer(name)
            base = base.strip()
            if tmpl and any(g.search(base) for g in self.generic):
                m = _KERNELISH.search(tmpl)
                if m:
                    base = f"{base}<{m.group(0)}>"
            name = base or name
        for pat, new in self.aliases:
            if pat.search(name):
                name = new
                break
        self._cache[raw] = name
        return name
