"""Shared by the census tests: the crafted data and the CLI run in-process (no interpreter
start per case)."""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import subprocess
from unittest import mock

from conftest import REPO

DATA = REPO / "tests" / "data" / "census"
TINY = DATA / "models" / "tiny-deepseek-v3"  # 3 layers, all MLA
KIMI = DATA / "models" / "kimi-k3"  # 93 layers: 69 KDA + 24 MLA


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """``k3rocm <args>`` through :func:`k3rocm.cli.main` with a clean K3_* environment."""
    from k3rocm.cli import main

    out, err = io.StringIO(), io.StringIO()
    env = {k: v for k, v in os.environ.items() if not k.startswith("K3_")}
    with mock.patch.dict(os.environ, env, clear=True), contextlib.chdir(REPO), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(list(args))
        except SystemExit as exc:  # argparse
            rc = exc.code if isinstance(exc.code, int) else 2
    return subprocess.CompletedProcess(["k3rocm", *args], rc, out.getvalue(), err.getvalue())


MT = runpy.run_path(str(DATA / "make_traces.py"))  # the crafted-trace builder
