"""TEST DOUBLE (CPU stand-in only): a known delay in every vLLM engine step.

Calibration switch for ``k3rocm ab --calibrate``: with ``K3_TEST_STEP_DELAY_MS=<ms>`` in the
server's environment, every engine step sleeps that long before it runs, so each decode step
(one output token per running request) takes ``ms`` longer: the inter-token latency grows by
``ms``. Without the variable it does nothing.

How it gets in: this directory is mounted at /opt/k3rocm-test by compose.cpu.yaml only when
``K3_TEST_PLUGINS_DIR`` points here, and put on PYTHONPATH; the ``.dist-info`` beside this
file registers :func:`register` as a vLLM general plugin (entry point group
``vllm.general_plugins``, see vllm/plugins/__init__.py ``load_general_plugins``). Never in
the serving image (the Dockerfile copies nothing from tests/).

Where the facts come from (vLLM 0.32.0 CPU stand-in, vllm/v1/engine/core.py):
``EngineCore.__init__`` calls ``load_general_plugins()`` before it picks
``self.step_fn = self.step if self.batch_queue is None else self.step_with_batch_queue``,
and ``run_busy_loop`` calls ``self.step_fn()`` once per engine step.
"""

import functools
import os
import time

ENV = "K3_TEST_STEP_DELAY_MS"


def register() -> None:
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return
    delay = float(raw) / 1000.0
    if delay <= 0:
        return
    from vllm.v1.engine.core import EngineCore

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
                    time.sleep(delay)
                return orig(self, *args, **kwargs)
            return delayed

        setattr(EngineCore, name, make(orig))
    EngineCore._k3_step_delay = delay
    print(f"[k3rocm-test] {ENV}={raw}: every engine step sleeps {raw} ms (test double)",
          flush=True)
