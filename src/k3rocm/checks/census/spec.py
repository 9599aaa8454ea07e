"""Which launches play which role: the one table in ``kernels.json`` (shipped as package data).

A *role* is a set of kernel/operator names (regular expressions over normalized names), owned
by one fusion of the fusion table (``serving/fusions.py``), as one of its ``fused`` roles (the
launch the fusion adds) or its ``stock`` roles (a launch the fusion removes):

- ``fused_qk_norm`` / ``qk_norm``: AITER ``fused_qk_rmsnorm_kernel`` / every separate RMSNorm
  launch (the MLA q/kv latent norms are two of them per MLA layer when the fusion is off; the
  model's other norms per step come from ``model_families`` so the q/kv share can be isolated).
- ``fused_qprep``: AITER's ``fuse_qk_rope_concat_and_cache_mla_*`` device kernels (the family;
  each launch is also assigned a *member*; a ``forbidden`` member must never run).
- ``cache_write`` / ``q_concat_quant``: the stock fp8 KV-cache write and the Inductor kernel that
  concatenates ``[ql_nope | q_pe]`` and quantizes it.

A launch counts for a role only when none of the operators it is nested in also matches that
role (CPU operators nest), and not when a parent matches ``exclude_parents``.
``--spec FILE`` (JSON, same shape as kernels.json) overrides roles per platform.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, Field, ValidationError

from k3rocm.errors import UsageError
from k3rocm.serving.fusions import FUSIONS

GROUPS = {f.name: f.roles for f in FUSIONS}  # fusion -> the roles it owns
ROLES = tuple(r for roles in GROUPS.values() for r in roles)
M = TypeVar("M", bound=BaseModel)


def kernel_table() -> dict[str, Any]:
    """The packaged kernels.json."""
    text = resources.files("k3rocm.checks.census").joinpath("kernels.json").read_text()
    return json.loads(text)


Patterns = list[re.Pattern[str]]


class Member(BaseModel):
    name: str = Field(alias="member")
    match: re.Pattern[str] = re.compile("")
    forbidden: bool = False
    why: str = ""
    source: str = ""


class Role(BaseModel):
    name: str
    match: Patterns = []
    exclude: Patterns = []
    exclude_parents: Patterns = []
    require_parents: Patterns = []
    members: list[Member] = []

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

    def member_of(self, name: str) -> str:
        return next((m.name for m in self.members if m.match.search(name)), "other")


class Beside(BaseModel):
    """Launches of a stock role next to its fused role: the contiguous run right before each
    ``fused`` launch and everything from it up to the next launch of an ``until`` role."""

    fused: str
    until: list[str]
    why: str = ""


class Pair(BaseModel):
    """The stock role's launches as the last run (nothing of the role between them) before
    each launch of an ``until`` role: one layer's own pair when it has exactly ``off``."""

    until: list[str]
    why: str = ""


class Expect(BaseModel):
    """What a role must show per MLA layer and step (kernels.json ``expect``), by what its
    fusion was asked; None = reported only."""

    label: str
    steps: str = Field(pattern="^(all|decode)$")
    on: int | None
    off: int | None
    prefill: int | None = None  # steps with prefill, whatever was asked
    separable: bool = False  # counts other launches too (every RMSNorm): needs other norms
    beside: Beside | None = None  # asked on, GPU: the stock launches beside the fused ones
    pair: Pair | None = None  # asked off, GPU: the layers whose own stock run is there
    why: dict[str, str] = {}

    def per_step(self, asked: bool) -> int | None:
        return self.on if asked else self.off


class Region(BaseModel):
    parents: Patterns = []  # host operators whose launches form the MLA attention region
    known_kernels: Patterns = []


@dataclass
class Spec:
    platform: str
    roles: dict[str, Role]
    other_norms_formula: str | None
    source: dict[str, Any]
    region: Region
    expect: dict[str, Expect]  # role -> what it must show (kernels.json ``expect``)


def _valid(model: type[M], data: Any, where: str) -> M:
    """``data`` as ``model``; the first problem as a one-line UsageError."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in err["loc"])
        raise UsageError(f"census spec {where}{loc}: {err['msg']} "
                         f"(got {str(err['input'])[:80]!r})") from None


def load_spec(platform: str, model_type: str | None, spec_file: str | None = None,
              other_norms: str | None = None) -> Spec:
    """Build the role matchers for ``platform`` (rocm|cpu) from kernels.json, optionally
    overridden by a JSON file of the same shape (roles replaced one by one)."""
    table = kernel_table()  # parsed afresh: updated in place below
    platforms = table["platforms"]
    families = table["model_families"]
    fam_of = table["family_of_model_type"]
    if spec_file:
        try:
            user = json.loads(Path(spec_file).read_text())
        except (OSError, ValueError) as exc:
            raise UsageError(f"--spec {spec_file} cannot be read as JSON ({exc})") from None
        if not isinstance(user, dict):
            raise UsageError(f"--spec {spec_file} must hold a JSON object")
        for plat, body in (user.get("platforms") or {}).items():
            if not isinstance(body, dict):
                raise UsageError(f"--spec {spec_file}: platforms.{plat} must be an object")
            dest = platforms.setdefault(plat, {"roles": {}, "mla_region": {"parents": []}})
            dest["roles"].update(body.get("roles") or {})
            if "mla_region" in body:
                dest["mla_region"] = body["mla_region"]
        table["expect"].update(user.get("expect") or {})
        families.update(user.get("model_families") or {})
        fam_of.update(user.get("family_of_model_type") or {})
    if platform not in platforms:
        raise UsageError(f"platform {platform!r} is not known; valid: "
                         f"{', '.join(sorted(platforms))}")
    roles = {}
    plat = platforms[platform]
    for rname in ROLES:
        r = plat["roles"].get(rname)
        if not isinstance(r, dict):
            raise UsageError(f"census spec: platform {platform!r} has no role {rname!r}")
        roles[rname] = _valid(Role, {**r, "name": rname}, f"{platform}.{rname}")
    expect = {}
    for rname in ROLES:
        if not isinstance(table["expect"].get(rname), dict):
            raise UsageError(f"census spec: no expectation for role {rname!r} (expect)")
        expect[rname] = e = _valid(Expect, table["expect"][rname], f"expect.{rname}")
        named = [*(e.beside.until + [e.beside.fused] if e.beside else []),
                 *(e.pair.until if e.pair else [])]
        if unknown := sorted(set(named) - set(ROLES)):
            raise UsageError(f"census spec expect.{rname} names unknown role(s) "
                             f"{', '.join(unknown)}; valid: {', '.join(ROLES)}")
    mla = _valid(Region, plat.get("mla_region") or {}, f"{platform}.mla_region")
    family = fam_of.get(model_type or "")
    formula = other_norms if other_norms is not None else \
        (families.get(family) or {}).get(platform) if family else None
    return Spec(platform, roles, formula,
                {"platform": platform, "roles": plat["roles"], "family": family,
                 "other_norms_per_step": formula, "spec_file": spec_file,
                 "table": "k3rocm/checks/census/kernels.json"}, mla, expect)


_FORMULA_OK = re.compile(r"^[\s\d+\-*()a-z_]*$")


def eval_formula(formula: str, variables: dict[str, int]) -> int:
    """Evaluate a tiny integer formula such as ``2*layers + 1`` (names, digits, + - * ())."""
    if not _FORMULA_OK.match(formula):
        raise UsageError(f"formula {formula!r} may only use integers, + - * ( ) and "
                         f"{', '.join(sorted(variables))}")
    unknown = set(re.findall(r"[a-z_]+", formula)) - set(variables)
    if unknown:
        raise UsageError(f"formula {formula!r} uses unknown name(s) {sorted(unknown)}; "
                         f"valid: {', '.join(sorted(variables))}")
    try:
        value = eval(formula, {"__builtins__": {}}, dict(variables))  # noqa: S307 - checked
    except Exception as exc:  # noqa: BLE001
        raise UsageError(f"formula {formula!r} cannot be evaluated ({exc})") from None
    return int(value)
