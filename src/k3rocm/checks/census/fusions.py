"""What the server was ASKED for: the claim the census judges.

The claim is the fusion toggles the server was started with: ``K3_FUSE_QK_NORM`` and
``K3_FUSE_DECODE_QPREP`` in the server container's environment (docker inspect, or the run's
provenance), default on when unset, exactly as the overlay reads them; or stated with
``--fusions qk_norm=on,decode_qprep=off``. The overlay's own decision records
(``census/decisions.py``) are cross-checked against this claim; they never set it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from k3rocm.errors import UsageError

FUSIONS = ("qk_norm", "decode_qprep")
ENV = {"qk_norm": "K3_FUSE_QK_NORM", "decode_qprep": "K3_FUSE_DECODE_QPREP"}


@dataclass
class FusionClaim:
    qk_norm: bool
    decode_qprep: bool
    source: str
    detail: dict[str, str] = field(default_factory=dict)  # per fusion: where the value came from

    def get(self, name: str) -> bool:
        return bool(getattr(self, name))

    def to_json(self) -> dict[str, Any]:
        return {"qk_norm": self.qk_norm, "decode_qprep": self.decode_qprep,
                "source": self.source, "detail": self.detail}


def parse_switch(value: str, what: str) -> bool:
    v = value.strip().lower()
    if v in ("1", "on", "true", "yes"):
        return True
    if v in ("0", "off", "false", "no"):
        return False
    raise UsageError(f"{what}={value!r} is not a switch; use on or off")


def from_cli(spec: str) -> FusionClaim:
    """``qk_norm=on,decode_qprep=off`` (also ``all=off``)."""
    vals: dict[str, bool] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, val = part.partition("=")
        key = key.strip()
        if not sep or key not in (*FUSIONS, "all"):
            raise UsageError(f"--fusions item {part!r} is not NAME=on|off with NAME one of "
                             f"{', '.join((*FUSIONS, 'all'))}")
        for k in (FUSIONS if key == "all" else (key,)):
            vals[k] = parse_switch(val, f"--fusions {k}")
    missing = [k for k in FUSIONS if k not in vals]
    if missing:
        raise UsageError(f"--fusions {spec!r} leaves {', '.join(missing)} unset; give both, "
                         "e.g. qk_norm=on,decode_qprep=off")
    return FusionClaim(vals["qk_norm"], vals["decode_qprep"], "--fusions",
                       {k: "stated with --fusions" for k in FUSIONS})


def from_env(env: Mapping[str, str], source: str) -> FusionClaim:
    """The toggles in a server's environment; unset or empty = on (the overlay's default)."""
    vals: dict[str, bool] = {}
    detail: dict[str, str] = {}
    for k, var in ENV.items():
        raw = env.get(var)
        if raw is None or raw.strip() == "":
            vals[k] = True
            detail[k] = f"{var} unset in {source} (default on)"
        else:
            vals[k] = parse_switch(raw, f"{var} in {source}")
            detail[k] = f"{var}={raw} in {source}"
    return FusionClaim(vals["qk_norm"], vals["decode_qprep"], source, detail)
