"""Steps of ``k3rocm demo`` and ``k3rocm selftest``: their rows, and each check's result as
a step note. ``run_step`` runs a command (demo: make targets) in its own process group, a log
file each, progress every 15 s; Ctrl-C stops the whole group."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3rocm.checks.census.spec import kernel_table
from k3rocm.serving.fusions import FUSIONS

REPO = Path(__file__).resolve().parents[3]
MAKE_ERROR = re.compile(r"^make(?:\[\d+\])?: \*\*\* \[[^\]]*\] Error (\d+)", re.M)
PROGRESS_EVERY = 15.0


@dataclass
class StepResult:
    name: str
    command: str
    code: int = 0  # the failing recipe's own exit code when make reports one
    seconds: float = 0.0
    ok: bool = False
    note: str = ""
    run_dir: str | None = None
    log: str | None = None
    numbers: dict[str, Any] = field(default_factory=dict)


class Interrupted(Exception):
    pass


def say(t0: float, msg: str, tag: str = "demo") -> None:
    print(f"[{tag} +{time.time() - t0:.0f}s] {msg}", file=sys.stderr, flush=True)


def _last_line(path: Path) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, fh.seek(0, 2) - 4096))
            tail = fh.read().decode(errors="replace")
    except OSError:
        return ""
    lines = [ln.strip() for ln in re.split(r"[\r\n]+", tail) if ln.strip()]
    return lines[-1][:140] if lines else ""


def _stop_group(proc: subprocess.Popen) -> None:
    """Ctrl-C the step's process group as a terminal would; escalate if it does not end."""
    for sig, wait in ((signal.SIGINT, 60), (signal.SIGTERM, 15), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_step(name: str, argv: list[str], env: dict[str, str], log: Path, t0: float,
             index: int, verbose: bool, total: int, tag: str = "demo") -> tuple[int, float, str]:
    """Run one command in its own process group; return (exit code, seconds, output)."""
    say(t0, f"{index}/{total} {name}: {shlex.join(argv)}", tag)
    start = time.time()
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE if verbose else out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            if verbose:
                for chunk in proc.stdout:  # type: ignore[union-attr] - stdout is a PIPE here
                    out.write(chunk)
                    out.flush()
                    sys.stderr.write(chunk.decode(errors="replace"))
                proc.wait()
            else:
                next_note = start + PROGRESS_EVERY
                while proc.poll() is None:
                    time.sleep(0.5)
                    if time.time() >= next_note:
                        say(t0, f"{index}/{total} {name}: {time.time() - start:.0f}s ... "
                            f"{_last_line(log)}", tag)
                        next_note += PROGRESS_EVERY
        except KeyboardInterrupt:
            say(t0, f"{index}/{total} {name}: interrupted, stopping it", tag)
            _stop_group(proc)
            raise Interrupted from None
    seconds = time.time() - start
    text = log.read_text(errors="replace")
    code = proc.returncode
    if code != 0:
        found = MAKE_ERROR.findall(text)
        if found:
            code = int(found[-1])  # the recipe's own exit code (make itself exits 2)
        code = code if code > 0 else 1
    return code, seconds, text


def new_dirs(root: Path, before: set[str], suffix: str) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir()
                  if p.is_dir() and p.name not in before and p.name.endswith(suffix))


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _num(value: Any, fmt: str = "{:.3g}") -> str:
    return fmt.format(value) if isinstance(value, (int, float)) else "?"


def bench_numbers(s: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A bench run's summary.json as the step's note and numbers (census, gsm8k: likewise)."""
    parts, points = [], []
    for p in s.get("points") or []:
        m = p.get("metrics") or {}
        ttft = (m.get("ttft") or {}).get("p50")
        itl = (m.get("itl") or {}).get("p50")
        tps = p.get("output_tps")
        stream = p.get("stream") or {}
        points.append({"concurrency": p.get("concurrency"), "status": p.get("status"),
                       "ttft_p50_ms": ttft, "itl_p50_ms": itl, "output_tokens_per_s": tps,
                       "tokens_per_chunk": stream.get("tokens_per_chunk"),
                       "stream_bunched": stream.get("bunched")})
        parts.append(f"c={p.get('concurrency')}: TTFT p50 {_num(ttft)} ms, ITL p50 "
                     f"{_num(itl)} ms, {_num(tps)} output tok/s"
                     + (f" ({stream['note']})" if stream.get("bunched") else ""))
    return "; ".join(parts) or f"status {s.get('status', '?')}", {"points": points}


def gsm8k_numbers(s: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    vals = {name: ((s.get("metrics") or {}).get(name) or {}).get("exact_match")
            for name in ("strict-match", "flexible-extract")}
    items = (s.get("items") or {}).get("evaluated")
    if items is None:
        return f"status {s.get('status', '?')}", {"status": s.get("status"),
                                                   "exit_code": s.get("exit_code")}
    text = (f"{items} items: strict-match {_num(vals['strict-match'], '{:.2f}')}, "
            f"flexible-extract {_num(vals['flexible-extract'], '{:.2f}')}, "
            f"status {s.get('status', '?')}")
    return text, {"status": s.get("status"), "exit_code": s.get("exit_code"), "items": items,
                  "exact_match": vals, "comparable": s.get("comparable")}


def census_numbers(c: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    checks = [ch for ch in c.get("checks") or [] if isinstance(ch, dict)]
    n_ok = sum(1 for ch in checks if ch.get("ok") is True)
    n_bad = sum(1 for ch in checks if ch.get("ok") is False)
    rank0 = next(iter(c.get("ranks") or []), {}) or {}
    layers = (c.get("model") or {}).get("mla_layers")
    verdict = c.get("verdict") or ("PASS" if c.get("ok") else "FAIL")  # census.json says
    parts = [f"{verdict}: {n_ok} checks ok, {n_bad} failed",
             f"{rank0.get('steps', '?')} engine steps ({rank0.get('decode_steps', '?')} "
             f"decode-only), {layers} MLA layers"]
    numbers: dict[str, Any] = {"ok": c.get("ok"), "verdict": verdict, "checks_ok": n_ok,
                               "checks_failed": n_bad,
                               "steps": rank0.get("steps"),
                               "decode_steps": rank0.get("decode_steps"), "mla_layers": layers}
    labels = kernel_table()["expect"]
    for role in (r for f in FUSIONS for r in f.roles):
        label = labels[role]["label"]
        ch = next((x for x in checks if x.get("role") == role and x.get("expected") is not None),
                  None)
        if ch:
            parts.append(f"{label} {ch.get('seen')} (expected {ch.get('expected')})")
            numbers[role] = {"seen": ch.get("seen"), "expected": ch.get("expected")}
    return "; ".join(parts), numbers


def verdict(code: int) -> str:
    return "OK" if code == 0 else ("INTERRUPTED" if code == 130 else f"FAILED (exit {code})")


def step_rows(results: list[StepResult], show=str) -> list[str]:
    """One row per step (state, seconds, note) and its run directory below it."""
    width = max((len(r.name) for r in results), default=4)
    lines = []
    for r in results:
        state = "ok" if r.ok else ("interrupted" if r.code == 130 else f"FAILED exit {r.code}")
        lines.append(f"  {r.name:<{width}}  {state:<14} {r.seconds:5.0f}s  {r.note}")
        if r.run_dir:
            lines.append(f"  {'':<{width}}  {'':<14} {'':>6}  -> {show(r.run_dir)}")
    return lines
