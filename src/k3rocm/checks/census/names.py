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
A name form this does not reduce to what kernels.json matches is a row (or a rule here) to add.
"""

from __future__ import annotations

import re
from functools import lru_cache

# Launcher names whose template arguments are the only thing that tells kernels apart.
_GENERIC = re.compile(r"^(?:ck_tile::kentry|ck::kernel_\w+|kernel|kernel_func)$")
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


@lru_cache(maxsize=1 << 16)
def normalize(raw: str) -> str:
    """The one name of a kernel/operator, whatever form the trace wrote it in."""
    name = _SUFFIXES.sub("", " ".join(raw.split()))
    name = _strip_args(_demangle_qualified(name)).removeprefix("void ")
    base, tmpl = _split_outer(name)
    base = base.strip()
    if tmpl and _GENERIC.search(base) and (m := _KERNELISH.search(tmpl)):
        base = f"{base}<{m.group(0)}>"
    return base or name
