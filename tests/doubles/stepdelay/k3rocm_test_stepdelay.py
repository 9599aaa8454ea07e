"""TEST DOUBLE (CPU stand-in only): a known delay in every vLLM engine step, and an engine hold.

Four switches, all read from the server's environment at plugin load:

- ``K3_TEST_STEP_DELAY_MS=<ms>`` (calibration switch for ``k3rocm ab --calibrate``): every
  engine step that has requests sleeps that long before it runs, so each decode step (one
  output token per running request) takes ``ms`` longer: the inter-token latency grows by ``ms``.
- ``K3_TEST_BASE_DELAY_MS=<ms>``: the same sleep, added to the one above; a test gives it to
  both arms of an A/B so a deterministic sleep dominates their step time (a loaded machine then
  moves the two servers' ITL much less) and the calibration's ``K3_TEST_STEP_DELAY_MS`` in arm B
  is the only difference.
- ``K3_TEST_HOLD_FILE=<path>`` (tests that must interrupt a client *while* a request is in
  flight): while that file exists, an engine step that has requests does not run. When the hold
  starts, the double writes ``<path>.held`` (its content: the number of unfinished requests) and
  prints one line, so a test waits for an observable event (the file), never for a sleep; it
  removes ``<path>.held`` when the hold ends. The HTTP server stays up (health, metrics) and
  the held requests are aborted or finished normally once the file is gone.
- ``K3_TEST_DELAY_FILE=<path>``: while that file exists, every engine step with requests
  sleeps the milliseconds written in it (read again whenever the file changes), so a test can
  slow a running server for a while (the session server of the tests: per-token streaming on
  a loaded 2-core machine, where the API server must never fall a whole step behind).

Without any of these variables it does nothing.

What it applied (every sleep above, whatever asked for it): the real duration of each sleep
(``time.perf_counter`` around it; on a loaded machine a sleep wakes late) is appended to
``APPLIED_FILE`` inside the server's container, one line per engine step that slept:
``<wall clock ns at its end> <requested ms> <applied ms>``. The line is written before the step
runs, so before any token of that step exists: a reader that starts after the client got its
last token sees every sleep behind those tokens (``k3rocm ab --calibrate-delay-ms`` copies the
file out of each arm server after its runs and judges the detector against the applied delay,
not the requested one).

How it gets in: this directory is mounted at /opt/k3rocm-test by compose.cpu.yaml only when
``K3_TEST_PLUGINS_DIR`` points here, and put on PYTHONPATH; the ``.dist-info`` beside this
file registers :func:`register` as a vLLM general plugin (entry point group
``vllm.general_plugins``, see vllm/plugins/__init__.py ``load_general_plugins``). Never in
the serving image (the Dockerfile copies nothing from tests/).

Where the facts come from (vLLM 0.32.0 CPU stand-in, vllm/v1/engine/core.py):
``EngineCore.__init__`` calls ``load_general_plugins()`` before it picks
``self.step_fn = self.step if self.batch_queue is None else self.step_with_batch_queue``,
and ``run_busy_loop`` calls ``self.step_fn()`` once per engine step; the busy loop handles
incoming requests (and aborts) between steps, so a held step still sees an abort once the
hold ends.
"""

import contextlib
import functools
import os
import time

ENV = "K3_TEST_STEP_DELAY_MS"
HOLD_ENV = "K3_TEST_HOLD_FILE"
DELAY_FILE_ENV = "K3_TEST_DELAY_FILE"
BASE_ENV = "K3_TEST_BASE_DELAY_MS"
# The record of the applied sleeps, inside the server's container (k3rocm.checks.bench.ab
# reads it from there: its STEP_DELAY_RECORD names the same path).
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
    """Appends one line per applied sleep to APPLIED_FILE (line-buffered: one write per step).
    If the file cannot be written the server keeps running and says so once; the record is
    then missing, which a calibration reports as "cannot judge"."""

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
