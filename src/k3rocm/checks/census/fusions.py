"""What the server was ASKED for (the claim the census judges): the ``K3_FUSE_*`` switches in
the server's rendered env (unset = on), or ``--fusions``. Decision records never set it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from k3rocm.errors import UsageError
from k3rocm.serving.fusions import BY_NAME, ENV, Fusion
from k3rocm.serving.fusions import NAMES as FUSIONS


@dataclass
class FusionClaim:
    asked: dict[str, bool]  # per fusion name (serving/fusions.py): asked on
    source: str
    detail: dict[str, str] = field(default_factory=dict)  # per fusion: where it came from

    def to_json(self) -> dict[str, Any]:
        return {**{k: self.asked[k] for k in FUSIONS}, "source": self.source,
                "detail": self.detail}


EXAMPLE = ",".join(f"{k}={'on' if i == 0 else 'off'}" for i, k in enumerate(FUSIONS))


def from_cli(spec: str) -> FusionClaim:
    """``qk_norm=on,decode_qprep=off`` (or ``all=off``): every fusion of the table."""
    vals: dict[str, bool] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, val = part.partition("=")
        key = key.strip()
        if not sep or not val.strip() or key not in (*FUSIONS, "all"):
            raise UsageError(f"--fusions item {part!r} is not NAME=on|off with NAME one of "
                             f"{', '.join((*FUSIONS, 'all'))}")
        for k in (FUSIONS if key == "all" else (key,)):
            vals[k] = _switch(BY_NAME[k], val, f"--fusions {k}")
    missing = [k for k in FUSIONS if k not in vals]
    if missing:
        raise UsageError(f"--fusions {spec!r} leaves {', '.join(missing)} unset; give each, "
                         f"e.g. {EXAMPLE}")
    return FusionClaim(vals, source="--fusions",
                       detail={k: "stated with --fusions" for k in FUSIONS})


def from_env(env: Mapping[str, str], source: str) -> FusionClaim:
    """The toggles in a server's environment, as the overlay reads them (unset = default)."""
    vals: dict[str, bool] = {}
    detail: dict[str, str] = {}
    for k, var in ENV.items():
        raw = env.get(var)
        vals[k] = _switch(BY_NAME[k], raw, f"{var} in {source}")
        detail[k] = (f"{var}={raw} in {source}" if (raw or "").strip() else
                     f"{var} unset in {source} (default {'on' if vals[k] else 'off'})")
    return FusionClaim(vals, source=source, detail=detail)


def _switch(f: Fusion, raw: str | None, what: str) -> bool:
    on = f.asked(raw)
    if on is None:
        raise UsageError(f"{what}={raw!r} is not a switch; use on or off")
    return on
