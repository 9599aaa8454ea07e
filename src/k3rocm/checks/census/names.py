"""Kernel / operator name normalization: every form kineto writes for one kernel gives one name.

CUDA/roctracer demangled ``void ns::k<T, 8>(T*, ...)``, rocprofiler-sdk ``... [clone .kd]`` or
``triton_..._0.kd``, and mangled ``_ZN...`` symbols: suffixes, ``void``, arguments and template
arguments are dropped; generic launchers (``ck_tile::kentry<...>``) keep their kernel type.
"""

from __future__ import annotations

import re
from functools import lru_cache

_GENERIC = re.compile(r"^(?:ck_tile::kentry|ck::kernel_\w+|kernel|kernel_func)$")
_KERNELISH = re.compile(r"[A-Za-z_][\w:]*(?:Kernel|Fwd|Bwd|Pipeline|kernel)\w*")


def _split_outer(name: str) -> tuple[str, str]:
    """(name without template args, the first top-level template argument list)."""
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


_SUFFIXES = re.compile(r"(?:\s*\[clone [^\]]*\]|\.kd)+$")


_LENGTH = re.compile(r"\d+")


def _demangle_qualified(name: str) -> str:
    """``_ZN5aiter23fused_qk_rmsnorm_kernelI...`` -> ``aiter::fused_qk_rmsnorm_kernel``."""
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
    """Cut at the first ``(`` outside ``<...>``; ``operator()`` keeps its name."""
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
