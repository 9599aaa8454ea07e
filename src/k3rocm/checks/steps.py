"""Steps of ``k3rocm demo`` and ``k3rocm selftest``. One :class:`Pipeline` runs them: timing, a
progress line every 15 s (the step's last output line), each step's output into its log,
Ctrl-C / SIGTERM -> exit 130 with the teardown shielded from a second one, and the summary
(stdout, summary.json, summary.md). Below it: each check's result as a step note."""

from __future__ import annotations

import codecs
import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from k3rocm.checks.census.spec import kernel_table
from k3rocm.errors import UsageError
from k3rocm.rundir import write_json_atomic, write_text_atomic
from k3rocm.serving.fusions import FUSIONS

REPO = Path(__file__).resolve().parents[3]
MAKE_ERROR = re.compile(r"^make(?:\[\d+\])?: \*\*\* \[[^\]]*\] Error (\d+)", re.M)
PROGRESS_EVERY = 15.0


@dataclass
class StepResult:
    name: str
    command: str | None = None  # the demo's make command
    code: int = 0  # the failing recipe's own exit code when make reports one
    seconds: float = 0.0
    ok: bool = False
    note: str = ""
    run_dir: str | None = None
    log: str | None = None
    numbers: dict[str, Any] = field(default_factory=dict)

    @property
    def state(self) -> str:
        return "ok" if self.ok else ("interrupted" if self.code == 130 else
                                     f"FAILED exit {self.code}")


class _Tee(io.TextIOBase):
    """A step's output: into its log (and stderr with --verbose); the last line kept."""

    def __init__(self, fh, echo):
        self.fh, self.echo, self.last = fh, echo, ""

    def write(self, text: str) -> int:
        self.fh.write(text)
        if self.echo is not None:
            self.echo.write(text)
        lines = [ln.strip() for ln in re.split(r"[\r\n]+", text) if ln.strip()]
        self.last = lines[-1][:140] if lines else self.last
        return len(text)


class Pipeline:
    """The steps ``names`` of one command, run one at a time; ``results`` their rows."""

    def __init__(self, tag: str, names: Sequence[str], verbose: bool = False,
                 t0: float | None = None):
        self.tag, self.names, self.verbose = tag, tuple(names), verbose
        self.t0 = time.time() if t0 is None else t0
        self.err = sys.stderr  # the terminal's, also while a step's output is captured
        self.results: list[StepResult] = []
        self.head = ""  # the running step's "i/n name"

    def say(self, msg: str) -> None:
        print(f"[{self.tag} +{time.time() - self.t0:.0f}s] {msg}", file=self.err, flush=True)

    def step(self, name: str, fn: Callable[[StepResult], Any], log: Path | None = None,
             what: str = "") -> StepResult:
        """``fn(res)`` fills the step's row (code, note, numbers, run dir). With ``log`` its
        stdout and stderr go there (and to stderr with --verbose), with a progress line every
        PROGRESS_EVERY s. A UsageError or Ctrl-C ends the step, recorded, and goes on up; so
        does a step that stopped on Ctrl-C itself and kept what it finished (its 130)."""
        self.head = head = f"{self.names.index(name) + 1}/{len(self.names)} {name}"
        self.say(head + (f": {what}" if what else "") + (f", log {log}" if log else ""))
        res, start = StepResult(name, log=str(log) if log else None), time.time()
        try:
            with self._captured(log, head, start) if log else contextlib.nullcontext():
                fn(res)
            res.ok = res.ok or res.code == 0
        except UsageError as exc:
            res.code, res.note = exc.exit_code, str(exc)
            raise
        except KeyboardInterrupt:
            res.code, res.note = 130, res.note or "interrupted"
            raise
        finally:
            res.seconds = time.time() - start
            self.results.append(res)
            self.say(f"{head}: {res.state} in {res.seconds:.0f}s"
                     + (f": {res.note}" if res.note else ""))
            if log and not res.ok and res.code != 130:
                tail = "\n".join(log.read_text(errors="replace").rstrip().splitlines()[-15:])
                print(f"--- last lines of {log}:\n{tail}\n---", file=self.err, flush=True)
        if res.code == 130:
            raise KeyboardInterrupt
        return res

    @contextlib.contextmanager
    def _captured(self, log: Path, head: str, start: float):
        log.parent.mkdir(parents=True, exist_ok=True)
        done = threading.Event()
        with open(log, "w", encoding="utf-8", buffering=1) as fh:
            out = _Tee(fh, self.err if self.verbose else None)

            def progress():
                while not done.wait(PROGRESS_EVERY):
                    self.say(f"{head}: {time.time() - start:.0f}s ... {out.last}")

            threading.Thread(target=progress, daemon=True).start()
            try:
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                    yield
            finally:
                done.set()

    def command(self, argv: list[str], env: dict[str, str]) -> tuple[int, str]:
        """Run ``argv`` in its own process group, its output into the step's; Ctrl-C stops the
        group as a terminal would. (exit code, output): a failing make recipe's own code."""
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        decode, text = codecs.getincrementaldecoder("utf-8")(errors="replace").decode, []
        try:
            for chunk in iter(lambda: proc.stdout.read1(1 << 16), b""):  # type: ignore[union-attr]
                text.append(decode(chunk))
                sys.stdout.write(text[-1])
            code = proc.wait()
        except KeyboardInterrupt:
            self.say(f"{self.head}: interrupted, stopping it")
            for sig, wait in ((signal.SIGINT, 60), (signal.SIGTERM, 15), (signal.SIGKILL, 10)):
                with contextlib.suppress(ProcessLookupError, subprocess.TimeoutExpired):
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=wait)
                    break
            raise
        out = "".join(text)
        found = MAKE_ERROR.findall(out)
        if code != 0 and found:
            code = int(found[-1])  # the recipe's own exit code (make itself exits 2)
        return (code if code >= 0 else 1), out

    def run(self, body: Callable[[], Any], teardown: Callable[[], Any]) -> int:
        """``body()`` runs the steps; Ctrl-C or SIGTERM there is exit 130, a UsageError its own
        code (one line); then ``teardown()`` with Ctrl-C ignored: a second one must not leave a
        server running. Else the exit code is the first failed step's."""
        code = None
        old_term = signal.signal(signal.SIGTERM, signal.default_int_handler)
        try:
            body()
        except KeyboardInterrupt:
            code = 130
        except UsageError as exc:
            code = exc.exit_code
            print(f"k3rocm: error: {exc}", file=sys.stderr)
        finally:
            signal.signal(signal.SIGTERM, old_term)
            old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
            try:
                teardown()
            finally:
                signal.signal(signal.SIGINT, old_int)
        return code if code is not None else next(
            (r.code or 1 for r in self.results if not r.ok), 0)

    def finish(self, code: int, run_dir: Path, title: str, doc: dict[str, Any],
               before: Sequence[str] = (), after: Sequence[str] = (), show=str) -> str:
        """The summary: printed, and as the run's summary.md and summary.json (``doc`` plus
        status, exit code, seconds and the steps)."""
        seconds = time.time() - self.t0
        width = max((len(r.name) for r in self.results), default=4)
        rows = []
        for r in self.results:
            rows.append(f"  {r.name:<{width}}  {r.state:<14} {r.seconds:5.0f}s  {r.note}")
            if r.run_dir:
                rows.append(f"  {'':<{width}}  {'':<14} {'':>6}  -> {show(r.run_dir)}")
        verdict, status = {0: ("OK", "ok"), 130: ("INTERRUPTED", "interrupted")}.get(
            code, (f"FAILED (exit {code})", "failed"))
        text = "\n".join([f"k3rocm {self.tag}: {verdict} in {seconds:.0f}s: {title}", "",
                          *before, *rows, "", *after])
        write_json_atomic(run_dir / "summary.json", {
            **doc, "status": status, "exit_code": code, "seconds": round(seconds, 1),
            "steps": [{**{k: v for k, v in asdict(r).items()
                          if k != "code" and (k != "command" or v is not None)},
                       "exit_code": r.code, "seconds": round(r.seconds, 1)}
                      for r in self.results]})
        write_text_atomic(run_dir / "summary.md", "```\n" + text + "\n```\n")
        print(text)
        return text


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
