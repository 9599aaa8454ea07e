"""Which launches play which role: the one table in ``kernels.json`` (package data).

A role (regexes over normalized names) is a ``fused`` or ``stock`` role of one fusion of
``serving/fusions.py``. A launch counts only when no enclosing operator also matches the role
(CPU operators nest) and no parent matches ``exclude_parents``.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from dataclasses import dataclass
from importlib import resources
from typing import Any

from pydantic import BaseModel, Field

from k3rocm.errors import UsageError
from k3rocm.serving.fusions import FUSIONS

ROLES = tuple(r for f in FUSIONS for r in f.roles)  # every fusion's, in table order


def kernel_table() -> dict[str, Any]:
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
        """``outermost``: CPU operators nest, so only the outermost match counts."""
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
    """Stock launches right before each ``fused`` launch and up to the next ``until`` one."""

    fused: str
    until: list[str]
    why: str = ""


class Pair(BaseModel):
    """The last run of stock launches before each ``until`` launch: the layer's own pair."""

    until: list[str]
    why: str = ""


class Expect(BaseModel):
    """Launches per MLA layer and step (kernels.json ``expect``) by what was asked; None =
    reported only."""

    label: str
    steps: str = Field(pattern="^(all|decode)$")
    on: int | None
    off: int | None
    prefill: int | None = None  # steps with prefill, whatever was asked
    separable: bool = False  # counts other launches too (every RMSNorm): needs other norms
    beside: Beside | None = None  # asked on, GPU: the stock launches beside the fused ones
    pair: Pair | None = None  # asked off, GPU: the layers whose own stock run is there
    why: dict[str, str] = {}


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


def load_spec(platform: str, model_type: str | None, other_norms: str | None = None) -> Spec:
    """Roles and expectations for ``platform`` (rocm|cpu); ``other_norms`` overrides the
    model family's formula."""
    table = kernel_table()
    plat = table["platforms"][platform]
    roles = {r: Role.model_validate({**plat["roles"][r], "name": r}) for r in ROLES}
    expect = {r: Expect.model_validate(table["expect"][r]) for r in ROLES}
    family = table["family_of_model_type"].get(model_type or "")
    formula = other_norms if other_norms is not None else \
        (table["model_families"].get(family) or {}).get(platform) if family else None
    return Spec(platform, roles, formula,
                {"platform": platform, "roles": plat["roles"], "family": family,
                 "other_norms_per_step": formula,
                 "table": "k3rocm/checks/census/kernels.json"},
                Region.model_validate(plat.get("mla_region") or {}), expect)


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def eval_formula(formula: str, variables: dict[str, int]) -> int:
    """An integer formula such as ``2*layers + 1`` (+ - * ( ), read with :mod:`ast`)."""
    names = ", ".join(sorted(variables))

    def value(node: ast.expr) -> int:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.Name):
            if node.id not in variables:
                raise UsageError(f"formula {formula!r} uses unknown name {node.id!r}; "
                                 f"valid: {names}")
            return variables[node.id]
        raise SyntaxError

    try:
        return value(ast.parse(formula.strip(), mode="eval").body)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise UsageError(f"formula {formula!r} may only use integers, + - * ( ) and "
                         f"{names}") from None
