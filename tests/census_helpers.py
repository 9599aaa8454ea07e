"""Shared by the census tests: the crafted data and the CLI run in-process (no interpreter
start per case)."""

from __future__ import annotations

import runpy
from pathlib import Path

from conftest import REPO, k3_in_process

from k3rocm.serving.modelfacts import KIMI_K3_MLA_LAYERS

DATA = REPO / "tests" / "data" / "census"
TINY = DATA / "models" / "tiny-deepseek-v3"  # 3 layers, all MLA
KIMI = DATA / "models" / "kimi-k3"  # 93 layers: 69 KDA + 24 MLA
run_cli = k3_in_process  # ``k3rocm <args>`` in-process, clean K3_* environment
MT = runpy.run_path(str(DATA / "make_traces.py"))  # the crafted-trace builder
SIX = [(0, 8)] * 6  # six decode-only steps of 8 requests


def write(d: Path, norm: str, qprep: str, model: Path = TINY, world: int = 2,
          per_rank: dict[int, dict] | None = None, **kw) -> Path:
    """One run's worker traces into ``d`` (``per_rank``: make_trace arguments per rank)."""
    d.mkdir(parents=True, exist_ok=True)
    mla, layers = ([i - 1 for i in KIMI_K3_MLA_LAYERS], 93) if model == KIMI else ([0, 1, 2], 3)
    for r in range(world):
        args = {"norm": norm, "qprep": qprep, **kw, **(per_rank or {}).get(r, {})}
        MT["write"](d / MT["trace_name"](r),
                    MT["make_trace"](r, world, mla, layers, SIX, **args), gz=True)
    return d


def census(d: Path | str, fusions: str, model: Path = TINY, records: bool = False,
           other: str | None = None, **kw):
    """Judge the traces in ``d`` (a name: under DATA), records beside them when ``records``."""
    from k3rocm.checks.census.analyze import run_census
    from k3rocm.checks.census.decisions import Decisions
    from k3rocm.checks.census.fusions import from_cli
    from k3rocm.checks.census.modelcfg import read_model_facts
    from k3rocm.checks.census.spec import load_spec
    from k3rocm.checks.census.trace import load_trace_dir
    from k3rocm.serving.decisions import decision_files, records_from_files

    d = DATA / d if isinstance(d, str) else d
    m = read_model_facts(model)
    ts = load_trace_dir(d)
    dec = Decisions(records_from_files(decision_files(d)), str(d)) if records else None
    return run_census(ts, m, from_cli(fusions), load_spec("rocm", m.model_type, other), dec,
                      ts.world_size or 1, "test", **kw)
