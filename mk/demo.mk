# The demo: the whole bundle on the CPU stand-in, one summary.
#   bash .ci/demo          on a fresh Debian/Ubuntu machine (root): set up, then `make demo`
#   make demo              on a machine that is set up: make tinymodel, make up CPU=1 (build FROM
#                          the stand-in, serve through entrypoint.sh + compose), make bench
#                          WORKLOAD=ci-tiny, make gsm8k (5 bundled items), make census, make down
#   make demo DEMO_ARGS='--port 18000 --verbose'   any `k3rocm demo` option (k3rocm demo --help)
#   make demo-test         tests/test_demo.py (runs the demo end to end)
PY ?= .venv/bin/python
DEMO_ARGS ?=

.PHONY: demo demo-test

demo: $(PY) ## the bundle on the CPU stand-in: build, serve, bench, gsm8k, census, one summary (DEMO_ARGS=)
	$(PY) -m k3rocm demo $(DEMO_ARGS)

demo-test: $(PY) ## the demo's tests (one runs it end to end on the stand-in)
	$(PY) -m pytest -ra tests/test_demo.py $(PYTEST_ARGS)
