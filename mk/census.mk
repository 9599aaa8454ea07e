# Decode kernel census. See docs/census.md.
#   make census                          profile the running server (needs K3_PROFILER_DIR set
#                                        when it started), check the fused-kernel counts
#   make census TRACE_DIR=results/traces analyse existing traces, no server (FUSIONS=... too)
#   make census CENSUS_ARGS='--concurrency 8 --max-tokens 1024 --steps 6'
#   make census-ab [CENSUS_IMAGE=...]    fusions off vs on, each arm on a fresh compose server
#                                        (= k3rocm ab --measure census; STOP_RUNNING=1)
#   make census-test                     the census tests (crafted traces + real CPU stand-in)
#   make census-bench [BENCH_SIZES=1,3,10] parser seconds and peak MB per million events
# Exit codes of k3rocm census: 0 every check passes, 1 a check failed, 2 bad input, 3 server problem.
PY ?= .venv/bin/python
TRACE_DIR ?=
FUSIONS ?=
CENSUS_ARGS ?=
CENSUS_AB_ARGS ?=
CENSUS_IMAGE ?= $(K3_IMAGE)

BENCH_SIZES ?= 1,3,10

.PHONY: census census-ab census-test census-bench

census: $(PY) ## kernel census of the running server (TRACE_DIR=dir: offline; CENSUS_ARGS)
	$(PY) -m k3rocm census $(if $(TRACE_DIR),--trace-dir $(TRACE_DIR)) $(if $(FUSIONS),--fusions $(FUSIONS)) $(CENSUS_ARGS)

census-ab: $(PY) ## kernel census A/B: fusions off vs on on fresh servers (CENSUS_IMAGE, CENSUS_AB_ARGS)
	$(PY) -m k3rocm ab --measure census $(if $(CENSUS_IMAGE),--image $(CENSUS_IMAGE)) $(if $(filter 1,$(CPU)),--no-gpu) $(if $(filter 1,$(STOP_RUNNING)),--stop-running) $(CENSUS_AB_ARGS)

census-test: $(PY) ## census tests: parser on crafted traces, A/B on the stand-in (live census: make demo-test)
	$(PY) -m pytest -q tests/test_census_parser.py tests/test_census_records.py tests/test_census_rocm2026.py tests/test_census_halves.py tests/test_census_standin.py

census-bench: $(PY) ## census parser benchmark: s and peak MB per million events (BENCH_SIZES=1,3,10)
	PYTHONPATH=src $(PY) tools/census_bench.py --sizes $(BENCH_SIZES)
