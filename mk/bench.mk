# Latency/throughput bench with aiperf in the client container (issue 5). See docs/bench.md.
#   make bench                              decode-8k1k against the running server
#   make bench WORKLOAD=agentic-68k         another workload (make bench-list shows them)
#   make bench WORKLOAD=decode-8k1k DRY_RUN=1   print the exact aiperf command line, contact nothing
#   make bench BENCH_ARGS='--tokenizer models/Kimi-K3 --set concurrency=1,2'
#   make bench-ab [REPEATS=4] [AA=1]        fusions off vs on (AA=1: A/A noise floor), each run on
#                                           a fresh server from BENCH_IMAGE, order A B B A ...
#   make clients-image                      build k3rocm/clients:<version> offline (wheels on host)
#   make bench-test                         the bench tests (real aiperf, real vLLM stand-in)
# Every workload field can be overridden with BENCH_<FIELD>=... in the environment, too.
# Exit codes of k3rocm bench/bench-ab: 0 ok, 1 a point/run failed (kept, marked failed),
# 2 bad input, 3 server unreachable, 130 interrupted (finished points kept).
PY ?= .venv/bin/python
WORKLOAD ?= decode-8k1k
BENCH_ARGS ?=
AB_ARGS ?=
REPEATS ?= 2
BENCH_IMAGE ?= $(or $(K3_IMAGE),k3rocm/server:latest)
CLIENT_BASE ?= python:3.11-slim-bookworm
CLIENTS_VERSION ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
CLIENTS_IMAGE ?= k3rocm/clients:$(CLIENTS_VERSION)
CLIENT_WHEELS ?= build/wheels/clients
# The wheels must match the image's Python 3.11: build them with a host Python 3.11.
CLIENT_PY ?= $(PY)

.PHONY: bench bench-ab bench-list clients-wheels clients-image bench-test

bench: $(PY) ## aiperf workload vs the running server (WORKLOAD=, DRY_RUN=1, BENCH_ARGS=)
	$(PY) -m k3rocm bench --workload $(WORKLOAD) $(if $(filter 1,$(DRY_RUN)),--dry-run) $(BENCH_ARGS)

bench-ab: $(PY) ## fusion A/B (AA=1: A/A) on fresh servers (WORKLOAD=, REPEATS=, BENCH_IMAGE=, AB_ARGS=)
	$(PY) -m k3rocm bench-ab --workload $(WORKLOAD) --repeats $(REPEATS) --image $(BENCH_IMAGE) $(if $(filter 1,$(AA)),--aa) $(if $(filter 1,$(DRY_RUN)),--dry-run) $(AB_ARGS)

bench-list: $(PY) ## list the bench workloads
	$(PY) -m k3rocm bench --list

$(CLIENT_WHEELS)/.complete: | $(PY)
	@$(CLIENT_PY) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' || \
	  { echo "clients-wheels: $(CLIENT_PY) is not Python 3.11 (the client image's); pass CLIENT_PY=python3.11"; exit 2; }
	mkdir -p $(CLIENT_WHEELS)
	$(CLIENT_PY) -m pip wheel --quiet -w $(CLIENT_WHEELS) "aiperf==0.13.0" "lm-eval[api]==0.4.13"
	touch $@

clients-wheels: $(CLIENT_WHEELS)/.complete ## download/build the client wheels on the host (Python 3.11)

clients-image: $(CLIENT_WHEELS)/.complete ## build the aiperf + lm-eval client image offline
	docker build -f docker/clients/Dockerfile --build-arg CLIENT_BASE=$(CLIENT_BASE) \
	  -t $(CLIENTS_IMAGE) $(CLIENT_WHEELS)

bench-test: $(PY) ## bench tests: workloads/stats units, real aiperf vs the CPU stand-in, A/B
	$(PY) -m pytest -q tests/test_bench_unit.py tests/test_bench_standin.py
