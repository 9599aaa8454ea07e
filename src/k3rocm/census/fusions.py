"""Fusion states: what the overlay reported at server start, or what the user states.

The overlay wrapper logs one line per fusion and process (see overlay/.../amd/mla.py):

    k3rocm overlay: q/kv RMSNorm fusion ON (fused_mla_dual_rms_norm; op source: aiter)
    k3rocm overlay: decode Q-prep fusion OFF (kv cache dtype auto is not fp8; kernel: ...)
    k3rocm overlay: decode Q-prep fusion OFF after load (backend wants a bf16 query)

The last word per process counts (a decision made at construction can be revoked after the
weights load). Every process must agree, otherwise the states are "mixed" and no expectation
can be derived.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from k3rocm.errors import UsageError

FUSIONS = ("qk_norm", "decode_qprep")
_LINE = re.compile(
    r"k3rocm overlay: (?P<what>q/kv RMSNorm|decode Q-prep) fusion (?P<state>ON|OFF)"
    r"(?P<after> after load)? \((?P<why>[^;)]*)")
_PROC = re.compile(r"^\((?P<proc>[^)]*?)(?: pid=(?P<pid>\d+))?\)")
_KEY = {"q/kv RMSNorm": "qk_norm", "decode Q-prep": "decode_qprep"}


@dataclass
class FusionStates:
    qk_norm: bool | None = None
    decode_qprep: bool | None = None
    source: str = "unknown"
    reasons: dict[str, str] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)

    def get(self, name: str) -> bool | None:
        return getattr(self, name)

    def to_json(self) -> dict[str, Any]:
        return {"qk_norm": self.qk_norm, "decode_qprep": self.decode_qprep,
                "source": self.source, "reasons": self.reasons, "log_lines": self.lines}


def parse_switch(value: str, what: str) -> bool:
    v = value.strip().lower()
    if v in ("1", "on", "true", "yes"):
        return True
    if v in ("0", "off", "false", "no"):
        return False
    raise UsageError(f"{what}={value!r} is not a switch; use on or off")


def from_cli(spec: str) -> FusionStates:
    """``qk_norm=on,decode_qprep=off`` (also ``all=off``)."""
    st = FusionStates(source="command line")
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, val = part.partition("=")
        key = key.strip()
        if not sep or key not in (*FUSIONS, "all"):
            raise UsageError(f"--fusions item {part!r} is not NAME=on|off with NAME one of "
                             f"{', '.join((*FUSIONS, 'all'))}")
        for k in (FUSIONS if key == "all" else (key,)):
            setattr(st, k, parse_switch(val, f"--fusions {k}"))
            st.reasons[k] = "stated on the command line"
    missing = [k for k in FUSIONS if st.get(k) is None]
    if missing:
        raise UsageError(f"--fusions {spec!r} leaves {', '.join(missing)} unset; give both, "
                         "e.g. qk_norm=on,decode_qprep=off")
    return st


def from_log(text: str, source: str = "server log") -> FusionStates:
    """States from the overlay's startup lines; raises UsageError when absent or mixed."""
    per_proc: dict[tuple[str, str], dict[str, tuple[bool, str]]] = {}
    lines = []
    for line in text.splitlines():
        m = _LINE.search(line)
        if not m:
            continue
        lines.append(line.strip())
        pm = _PROC.match(line.strip())
        proc = (pm.group("proc"), pm.group("pid") or "") if pm else ("main", "")
        per_proc.setdefault(proc, {})[_KEY[m.group("what")]] = (
            m.group("state") == "ON", m.group("why").strip())
    if not lines:
        raise UsageError(f"no 'k3rocm overlay: ... fusion ON|OFF' line in the {source}: the "
                         "overlay did not run (stock vLLM, K3_OVERLAY=off, or the model is not "
                         "Kimi-K3); state the fusions with --fusions qk_norm=off,decode_qprep=off")
    st = FusionStates(source=source, lines=lines[:20])
    for key in FUSIONS:
        vals = {v[key][0] for v in per_proc.values() if key in v}
        if not vals:
            raise UsageError(f"the {source} reports no state for the {key} fusion; "
                             "pass --fusions")
        if len(vals) > 1:
            raise UsageError(f"the {source} reports the {key} fusion ON in some processes and "
                             "OFF in others; no single expectation applies")
        setattr(st, key, vals.pop())
        st.reasons[key] = next(v[key][1] for v in per_proc.values() if key in v)
    return st
