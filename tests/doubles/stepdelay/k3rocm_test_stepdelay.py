"""TEST DOUBLE (CPU stand-in only): a known delay in every vLLM engine step, and an engine hold.

Switches (the server's environment at plugin load; none set: it does nothing):
- ``K3_TEST_STEP_DELAY_MS`` (arm B of ``--calibrate-delay-ms``) and ``K3_TEST_BASE_DELAY_MS``
  (both arms: a deterministic sleep dominates the step): every engine step with requests sleeps
  their sum first, so ITL grows by it.
- ``K3_TEST_HOLD_FILE=<path>``: while it exists, a step with requests does not run; the hold is
  announced by writing ``<path>.held`` (unfinished requests), removed when it ends.
- ``K3_TEST_DELAY_FILE=<path>``: while it exists, every step sleeps the ms written in it.
Each sleep's real duration goes to ``APPLIED_FILE`` (``<ns> <requested ms> <applied ms>``),
written before the step runs; bench-ab copies it out and judges against the applied delay.

Mounted at /opt/k3rocm-test by compose.cpu.yaml from ``K3_TEST_PLUGINS_DIR``, put on PYTHONPATH;
the ``.dist-info`` registers :func:`register` as a vLLM general plugin. vLLM 0.32.0
(vllm/v1/engine/core.py): ``EngineCore.__init__`` loads general plugins before it picks
``step_fn`` (``step`` or ``step_with_batch_queue``), which ``run_busy_loop`` calls once per step.
"""

import contextlib
import functools
import os
import time

ENV = "K3_TEST_STEP_DELAY_MS"
HOLD_ENV = "K3_TEST_HOLD_FILE"
DELAY_FILE_ENV = "K3_TEST_DELAY_FILE"
BASE_ENV = "K3_TEST_BASE_DELAY_MS"
# inside the server's container; k3rocm.checks.bench.ab.STEP_DELAY_RECORD names the same path
APPLIED_FILE = "/tmp/k3rocm-test-stepdelay.tsv"
HOLD_POLL_S = 0.01  # how often a held step looks at the hold file (inside the server)


def _held(self, hold: str) -> None:
    """Block this engine step while ``hold`` exists; announce the hold with ``hold.held``."""
    if not os.path.exists(hold):
        return
    marker = hold + ".held"
    n = self.scheduler.get_num_unfinished_requests()
    tmp = f"{marker}.{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        fh.write(f"{n}\n")
    os.replace(tmp, marker)
    print(f"[k3rocm-test] {HOLD_ENV}: engine held with {n} unfinished request(s)", flush=True)
    while os.path.exists(hold):
        time.sleep(HOLD_POLL_S)
    with contextlib.suppress(FileNotFoundError):
        os.remove(marker)
    print(f"[k3rocm-test] {HOLD_ENV}: engine released", flush=True)


class _DelayFile:
    """The delay (seconds) written in a file, re-read when its mtime changes; 0 without it."""

    def __init__(self, path: str):
        self.path, self.stamp, self.value = path, None, 0.0

    def seconds(self) -> float:
        try:
            stamp = os.stat(self.path).st_mtime_ns
        except FileNotFoundError:
            self.stamp, self.value = None, 0.0
            return 0.0
        if stamp != self.stamp:
            try:
                with open(self.path) as fh:
                    self.value = max(0.0, float(fh.read().strip() or 0)) / 1000.0
            except (OSError, ValueError):
                self.value = 0.0
            self.stamp = stamp
        return self.value


class _Record:
    """One line per applied sleep in APPLIED_FILE; unwritable: said once, the server runs on."""

    def __init__(self, path: str):
        self.path, self.fh, self.failed = path, None, False

    def sleep(self, seconds: float) -> None:
        t0 = time.perf_counter()
        time.sleep(seconds)
        applied = time.perf_counter() - t0
        if self.failed:
            return
        try:
            if self.fh is None:
                self.fh = open(self.path, "a", buffering=1)  # noqa: SIM115 - the process's life
            self.fh.write(f"{time.time_ns()} {seconds * 1000:.4f} {applied * 1000:.4f}\n")
        except OSError as exc:
            self.failed = True
            print(f"[k3rocm-test] cannot record the applied sleeps in {self.path}: {exc}",
                  flush=True)


def register() -> None:
    raw = os.environ.get(ENV, "").strip()
    base = os.environ.get(BASE_ENV, "").strip()
    delay = (float(raw) if raw else 0.0) / 1000.0 + (float(base) if base else 0.0) / 1000.0
    hold = os.environ.get(HOLD_ENV, "").strip()
    delay_file = _DelayFile(os.environ[DELAY_FILE_ENV]) \
        if os.environ.get(DELAY_FILE_ENV, "").strip() else None
    if delay <= 0 and not hold and delay_file is None:
        return
    from vllm.v1.engine.core import EngineCore

    record = _Record(APPLIED_FILE)
    if getattr(EngineCore, "_k3_step_delay", None) is not None:
        return
    for name in ("step", "step_with_batch_queue"):
        orig = getattr(EngineCore, name, None)
        if orig is None:
            continue

        def make(orig):
            @functools.wraps(orig)
            def delayed(self, *args, **kwargs):
                if self.scheduler.has_requests():
                    if hold:
                        _held(self, hold)
                    extra = delay_file.seconds() if delay_file is not None else 0.0
                    if delay + extra > 0:
                        record.sleep(delay + extra)
                return orig(self, *args, **kwargs)
            return delayed

        setattr(EngineCore, name, make(orig))
    EngineCore._k3_step_delay = delay
    if delay > 0:
        print(f"[k3rocm-test] {ENV}={raw or 0} {BASE_ENV}={base or 0}: every engine step "
              f"sleeps {delay * 1000:g} ms (test double; each sleep's real duration goes to "
              f"{APPLIED_FILE})", flush=True)
    if hold:
        print(f"[k3rocm-test] {HOLD_ENV}={hold}: engine steps wait while that file exists "
              "(test double)", flush=True)
    if delay_file is not None:
        print(f"[k3rocm-test] {DELAY_FILE_ENV}={delay_file.path}: engine steps sleep the ms "
              "written there while it exists (test double)", flush=True)
