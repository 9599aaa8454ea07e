# Latency/throughput bench with aiperf in the client container. See docs/bench.md.
#   make bench                              decode-8k1k against the running server
#   make bench WORKLOAD=agentic-68k         another workload (make bench-list shows them)
#   make bench WORKLOAD=decode-8k1k DRY_RUN=1   print the exact aiperf command line, contact nothing
#   make bench BENCH_ARGS='--set concurrency=1,2'   URL, model, API key, tokenizer (the checkpoint
#                                           dir) and results root: from the K3_* settings
#   make bench-ab [REPEATS=4] [AA=1]        fusions off vs on (AA=1: A/A noise floor), each run on
#                                           a fresh compose server from BENCH_IMAGE, order A B B A
#                                           ... (= k3rocm ab --measure bench; STOP_RUNNING=1 stops
#                                           a server already on the port first)
#   make clients-image                      build k3rocm/clients:<version> offline from the hashed
#                                           lock docker/clients/requirements.lock (make clients-lock)
#   make bench-test                         the bench tests (real aiperf, real vLLM stand-in)
# Every workload field can be overridden with BENCH_<FIELD>=... in the environment, too.
# Exit codes of k3rocm bench/bench-ab (README "Exit codes"): 0 ok, 1 a point/run failed (kept,
# marked failed), 2 bad input, 3 server unreachable or no Docker engine, 130 interrupted
# (finished points kept).
PY ?= .venv/bin/python
WORKLOAD ?= decode-8k1k
BENCH_ARGS ?=
AB_ARGS ?=
REPEATS ?=
BENCH_IMAGE ?= $(K3_IMAGE)
CLIENT_BASE ?= python:3.11-slim-bookworm
CLIENTS_VERSION ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
CLIENTS_IMAGE ?= k3rocm/clients:$(CLIENTS_VERSION)
CLIENT_LOCK := docker/clients/requirements.lock
# One directory per lock content, outside the checkout (K3ROCM_CACHE): a fresh clone reuses it, a
# changed lock gets a new one. The download checks every file's sha256 against the lock, the
# image build installs with --require-hashes.
CLIENT_WHEELS ?= $(K3ROCM_CACHE)/wheels/clients-$(shell sha256sum $(CLIENT_LOCK) | cut -c1-16)
# Any host Python with pip fetches the locked files (docker/clients/clientlock.py names the
# image's CPython 3.11 / manylinux x86_64 itself); the lock is resolved inside CLIENT_BASE.
CLIENT_PY ?= $(PY)
HOST_CA ?= $(wildcard /etc/ssl/certs/ca-certificates.crt)

.PHONY: bench bench-ab bench-list clients-lock clients-wheels clients-image bench-test

bench: $(PY) ## aiperf workload vs the running server (WORKLOAD=, DRY_RUN=1, BENCH_ARGS=)
	$(PY) -m k3rocm bench --workload $(WORKLOAD) $(if $(filter 1,$(DRY_RUN)),--dry-run) $(BENCH_ARGS)

bench-ab: $(PY) ## fusion A/B (AA=1: A/A) on fresh servers (WORKLOAD=, REPEATS=, BENCH_IMAGE=, AB_ARGS=)
	$(PY) -m k3rocm ab --measure bench --workload $(WORKLOAD) $(if $(REPEATS),--repeats $(REPEATS)) $(if $(BENCH_IMAGE),--image $(BENCH_IMAGE)) $(if $(filter 1,$(CPU)),--no-gpu) $(if $(filter 1,$(AA)),--aa) $(if $(filter 1,$(STOP_RUNNING)),--stop-running) $(if $(filter 1,$(DRY_RUN)),--dry-run) $(AB_ARGS)

bench-list: $(PY) ## list the bench workloads
	$(PY) -m k3rocm bench --list

clients-lock: | $(PY) ## re-resolve docker/clients/requirements.lock inside CLIENT_BASE (Python 3.11; needs PyPI)
	rm -rf build/clients-lock && mkdir -p build/clients-lock
	docker run --rm --network host --user "$$(id -u):$$(id -g)" -e HOME=/tmp \
	  $(if $(HOST_CA),-v $(HOST_CA):/tmp/host-ca.crt:ro -e PIP_CERT=/tmp/host-ca.crt) \
	  -v "$(CURDIR)/docker/clients/requirements.in:/in/requirements.in:ro" \
	  -v "$(CURDIR)/build/clients-lock:/out" $(CLIENT_BASE) sh -c 'python3 -m venv /tmp/v && \
	  /tmp/v/bin/pip install --quiet --disable-pip-version-check --dry-run --ignore-installed \
	  --report /out/report.json -r /in/requirements.in'
	$(PY) docker/clients/clientlock.py lock --report build/clients-lock/report.json \
	  --base-image $(CLIENT_BASE) --out $(CLIENT_LOCK)

$(CLIENT_WHEELS)/.complete: | $(PY)
	$(CLIENT_PY) docker/clients/clientlock.py download --lock $(CLIENT_LOCK) --dest $(CLIENT_WHEELS)

clients-wheels: $(CLIENT_WHEELS)/.complete ## fetch the locked client wheels (any host Python, sha256-checked)

clients-image: $(CLIENT_WHEELS)/.complete ## build the aiperf + lm-eval client image offline from the hashed lock
	docker build -f docker/clients/Dockerfile --build-arg CLIENT_BASE=$(CLIENT_BASE) \
	  --build-arg CLIENT_LOCK_SHA256=$$(sha256sum $(CLIENT_LOCK) | cut -d' ' -f1) \
	  -t $(CLIENTS_IMAGE) $(CLIENT_WHEELS)

bench-test: $(PY) ## bench tests: workloads/stats units, real aiperf vs the CPU stand-in, A/B
	$(PY) -m pytest -q tests/test_bench_unit.py tests/test_bench_standin.py tests/test_bench_ab_standin.py
