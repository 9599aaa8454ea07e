"""Kernel / operator name normalization.

GPU kernel names in a chrome trace carry C++ noise: ``void vllm::rms_norm_kernel<c10::BFloat16,
8>(c10::BFloat16*, ...)``. A census counts launches per *kernel*, not per instantiation, so the
normalizer strips the return type, the argument list and template arguments. Generic launcher
names (CK-tile's ``ck_tile::kentry<...>``) would all collapse into one bucket, so for those the
first kernel-like type inside the template arguments is kept: ``ck_tile::kentry<Rmsnorm2dFwd>``.
A trailing ``.kd`` (the code-object descriptor suffix some ROCm traces print, e.g.
``triton_poi_fused__to_copy_cat_clamp_mul_reciprocal_view_0.kd``) is dropped.
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
    first_tmpl: list[str] = []
    depth = 0
    seen_first = False
    for ch in name:
        if ch == "<":
            depth += 1
            if depth == 1 and not seen_first:
                continue
        elif ch == ">" and depth > 0:
            depth -= 1
            if depth == 0:
                seen_first = True
            continue
        if depth == 0:
            out.append(ch)
        elif not seen_first:
            first_tmpl.append(ch)
    return "".join(out), "".join(first_tmpl)


def _strip_args(name: str) -> str:
    """Drop a trailing ``(...)`` argument list (balanced), keeping ``(anonymous namespace)``."""
    name = name.replace("(anonymous namespace)::", "")
    if not name.endswith(")"):
        return name
    depth = 0
    for i in range(len(name) - 1, -1, -1):
        if name[i] == ")":
            depth += 1
        elif name[i] == "(":
            depth -= 1
            if depth == 0:
                head = name[:i].rstrip()
                # "operator()" and the like: keep the name if stripping leaves nothing useful
                return head if head and not head.endswith("operator") else name
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
    def from_specs(cls, aliases: Iterable[str] = (), strip_templates: bool = True,
                   generic: Iterable[str] | None = None) -> Normalizer:
        """``aliases``: ``REGEX=NAME`` strings (applied to the normalized name, first wins)."""
        pairs: list[tuple[re.Pattern[str], str]] = []
        for spec in aliases:
            if "=" not in spec:
                raise UsageError(f"kernel alias {spec!r} is not REGEX=NAME "
                                 "(e.g. 'rms_norm_kernel$=rms_norm')")
            pat, _, new = spec.rpartition("=")
            pairs.append((compile_regex(pat, "kernel alias"), new))
        gen = [compile_regex(p, "generic kernel name") for p in
               (DEFAULT_GENERIC if generic is None else generic)]
        return cls(strip_templates=strip_templates, aliases=pairs, generic=gen)

    def __call__(self, raw: str) -> str:
        hit = self._cache.get(raw)
        if hit is not None:
            return hit
        name = " ".join(raw.split())
        if name.endswith(".kd"):  # code-object symbol suffix in some ROCm traces
            name = name[:-3]
        if self.strip_templates:
            name = _strip_args(name)
            if name.startswith("void "):
                name = name[5:]
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


def compile_regex(pattern: str, what: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise UsageError(f"{what} {pattern!r} is not a valid regular expression ({exc})") from None
