# Kimi-K3 on 8x AMD MI355X with vLLM.  `make help` lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PY ?= .venv/bin/python
# CPU=1 adds the CPU override (no AMD devices; stand-in base image and the cpu-smoke profile).
CPU ?= 0
# COMPOSE_FILE (exported) is how every `docker compose` call, ours and k3rocm's, sees the same files.
COMPOSE_FILE := compose.yaml$(if $(filter 1,$(CPU)),:compose.cpu.yaml)
export COMPOSE_FILE
COMPOSE := docker compose
# The host's group ids for /dev/kfd and /dev/dri (a group *name* would resolve inside the image).
K3_VIDEO_GID ?= $(shell getent group video 2>/dev/null | cut -d: -f3)
K3_RENDER_GID ?= $(shell getent group render 2>/dev/null | cut -d: -f3)
export K3_VIDEO_GID K3_RENDER_GID
VENDOR_ENV := .k3rocm/vendor.env
GIT_REV ?= $(shell git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
export GIT_REV
# The base image a build uses (BASE_IMAGE, else the compose files' default) and its registry
# digest, known once it was pulled (a locally built or retagged image has none): the build
# records it in the image's manifest and label, `make preflight` prints it (docs/profiles.md).
BASE_REF = $(or $(BASE_IMAGE),$(shell sed -n 's/.*BASE_IMAGE: $${BASE_IMAGE:-\([^}]*\)}.*/\1/p' $(subst :, ,$(COMPOSE_FILE)) | tail -1))
BASE_DIGEST ?= $(shell docker image inspect --format '{{index .RepoDigests 0}}' '$(BASE_REF)' 2>/dev/null)
export BASE_DIGEST
CONFIG_ENV := $(if $(filter 1,$(CPU)),K3_PROFILE=$${K3_PROFILE:-cpu-smoke})

.PHONY: help venv config build up wait down logs test lint smoke ci-images

help: ## list the targets
	@grep -hE '^[a-zA-Z0-9_-]+:.*## ' $(MAKEFILE_LIST) | sort -u | \
	  awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

# uv installs what pip would, from PyPI, in parallel and from its cache (~/.cache/uv): a fresh
# clone's venv in ~10 s instead of ~45 s (pip asks the index one package at a time). The venv
# keeps pip (router-wheels uses it).
UV_VERSION ?= 0.13.9
# Downloads kept between checkouts (src/k3rocm/dev/standin.py CACHE_ROOT: the same place), each
# keyed by the sha256 of what it holds or of its lock file, never by a date.
K3ROCM_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/k3rocm
venv: $(PY) ## create .venv with the package, host tools and test tools
$(PY): pyproject.toml
	python3 -m venv .venv
	.venv/bin/pip install --quiet 'uv==$(UV_VERSION)'
	.venv/bin/uv pip install --quiet --python $(PY) -e '.[host,dev]'
	@touch $(PY)

# `make config` only prints: the commands that start something (build, up) write $(VENDOR_ENV)
# from their own shell, so a print never changes what the next start passes.
config: $(PY) ## print the resolved settings, where each came from, env and argv (writes nothing)
	@$(CONFIG_ENV) $(PY) -m k3rocm config --host-paths --base-facts

build: $(PY) ## build the serving image (BASE_IMAGE=... to override the default vLLM v0.34.0 base)
	@$(CONFIG_ENV) $(PY) -m k3rocm config --host-paths --vendor-env-file $(VENDOR_ENV) >/dev/null
	$(COMPOSE) build server

up: $(PY) ## preflight, validate, build, start the server and wait until it is ready (progress shown)
	@$(CONFIG_ENV) $(PY) -m k3rocm config --host-paths --vendor-env-file $(VENDOR_ENV) \
	    --make-dirs >/dev/null
	@$(if $(filter 1,$(CPU)),true,$(PY) -m k3rocm preflight $(PREFLIGHT_ARGS))
	@$(CONFIG_ENV) $(PY) -m k3rocm server up --build $(WAIT_ARGS)

wait: $(PY) ## wait until the already started server is ready (WAIT_ARGS='--timeout 600')
	@$(CONFIG_ENV) $(PY) -m k3rocm server wait $(WAIT_ARGS)

down: $(PY) ## save the server log into results/, then stop and remove the server
	@$(CONFIG_ENV) $(PY) -m k3rocm server down

logs: ## follow the server log
	$(COMPOSE) logs -f server

# Three pytest-xdist workers on a 2-core CI machine: the suite is CPU-bound there; a third
# worker overlaps Docker waits and, on a busy machine, holds a larger share of the CPU (a loaded
# run: 1,168 s vs 1,192-1,316 s with two). Whole modules per worker (module fixtures shared);
# each worker starts its own session stand-in server; the longest files are dealt first
# (tests/conftest.py HEAVY_FIRST). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 3
test: $(PY) ## run the test suite (needs the Docker engine: see .ci/run; TEST_WORKERS=0 serial)
	$(PY) -m pytest -ra --durations=0 --durations-min=5 $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder) $(PYTEST_ARGS)

lint: $(PY) ## ruff, hadolint, shellcheck
	$(PY) -m ruff check .
	.venv/bin/hadolint Dockerfile $(wildcard docker/*/Dockerfile)
	.venv/bin/shellcheck entrypoint.sh .ci/run .ci/demo .ci/*.sh

smoke: $(PY) ## build FROM the stand-in (or BASE_IMAGE=<ROCm image> GPU=1), serve the tiny model, one request
	$(PY) -m k3rocm smoke $(if $(BASE_IMAGE),--base-image $(BASE_IMAGE)) $(if $(filter 1,$(GPU)),--gpu --profile $${K3_PROFILE:-cpu-smoke}) $(SMOKE_ARGS)

ci-images: $(PY) ## CI: both CPU stand-in bases (see mk/standin.mk), the client and router images, no pulls
	@# two single-threaded builds at once (one per core); each one's output is printed whole
	$(MAKE) -j2 --output-sync=recurse standin ci-client-images

.PHONY: ci-client-images
ci-client-images:
	$(MAKE) clients-image CLIENT_BASE=k3rocm/debian:bookworm
	$(MAKE) router-image ROUTER_BASE=k3rocm/debian:bookworm

-include mk/*.mk
