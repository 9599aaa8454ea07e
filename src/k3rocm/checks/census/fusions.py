"""What the server was ASKED for (the claim the census judges): the ``K3_FUSE_*`` switches in
the server's rendered env read as the overlay reads them (``Fusion.asked``: unset = the row's
default), or ``--fusions``. Decision records never set it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from k3rocm.errors import UsageError
from k3rocm.serving.fusions import BY_NAME, FUSIONS, NAMES


@dataclass
class FusionClaim:
    asked: dict[str, bool]  # per fusion name (serving/fusions.py), in table order: asked on
    source: str
    detail: dict[str, str]  # per fusion: where it came from

    def to_json(self) -> dict[str, Any]:
        return {**self.asked, "source": self.source, "detail": self.detail}


def from_cli(spec: str) -> FusionClaim:
    """``qk_norm=on,decode_qprep=off`` (or ``all=off``): every fusion of the table."""
    vals: dict[str, bool] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, val = (s.strip() for s in part.partition("="))
        if not sep or not val or key not in (*NAMES, "all"):
            raise UsageError(f"--fusions item {part!r} is not NAME=on|off with NAME one of "
                             f"{', '.join((*NAMES, 'all'))}")
        vals |= {k: _switch(k, val, f"--fusions {k}") for k in (NAMES if key == "all" else [key])}
    if missing := [k for k in NAMES if k not in vals]:
        example = ",".join(f"{k}={'off' if i else 'on'}" for i, k in enumerate(NAMES))
        raise UsageError(f"--fusions {spec!r} leaves {', '.join(missing)} unset; give each, "
                         f"e.g. {example}")
    return FusionClaim({k: vals[k] for k in NAMES}, "--fusions",
                       dict.fromkeys(NAMES, "stated with --fusions"))


def from_env(env: Mapping[str, str], source: str) -> FusionClaim:
    """The toggles in a server's environment (unset = the row's default)."""
    asked = {f.name: _switch(f.name, env.get(f.env), f"{f.env} in {source}") for f in FUSIONS}
    return FusionClaim(asked, source, {
        f.name: f"{f.env}={env[f.env]} in {source}" if (env.get(f.env) or "").strip() else
        f"{f.env} unset in {source} (default {'on' if asked[f.name] else 'off'})"
        for f in FUSIONS})


def _switch(name: str, raw: str | None, what: str) -> bool:
    if (on := BY_NAME[name].asked(raw)) is None:
        raise UsageError(f"{what}={raw!r} is not a switch; use on or off")
    return on
