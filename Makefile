# Kimi-K3 on 8x AMD MI355X with vLLM.  `make help` lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PY ?= .venv/bin/python
# CPU=1 adds the CPU override (no AMD devices; stand-in base image and the cpu-smoke profile).
CPU ?= 0
COMPOSE_FILES := -f compose.yaml $(if $(filter 1,$(CPU)),-f compose.cpu.yaml)
COMPOSE := docker compose $(COMPOSE_FILES)
GIT_REV ?= $(shell git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
export GIT_REV
CONFIG_ENV := $(if $(filter 1,$(CPU)),K3_PROFILE=$${K3_PROFILE:-cpu-smoke})

.PHONY: help venv config build up down logs test lint smoke ci-images

help: ## list the targets
	@grep -hE '^[a-zA-Z0-9_-]+:.*## ' $(MAKEFILE_LIST) | sort -u | \
	  awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

venv: $(PY) ## create .venv with the package, host tools and test tools
$(PY): pyproject.toml
	python3 -m venv .venv
	.venv/bin/pip install --quiet -e '.[host,dev]'
	@touch $(PY)

config: $(PY) ## print the resolved serving settings, where each came from, env and argv
	@$(CONFIG_ENV) $(PY) -m k3rocm config --host-paths

build: $(PY) ## build the serving image (BASE_IMAGE=... to override the pinned nightly)
	@$(CONFIG_ENV) $(PY) -m k3rocm config --host-paths >/dev/null
	$(COMPOSE) build server

up: $(PY) ## validate the settings, build and start the server in the background
	@$(CONFIG_ENV) $(PY) -m k3rocm config --host-paths >/dev/null
	$(COMPOSE) up -d --build server
	@echo "server starting: 'make logs' to follow, health: docker compose ps"

down: ## stop and remove the server
	$(COMPOSE) down

logs: ## follow the server log
	$(COMPOSE) logs -f server

test: $(PY) ## run the test suite (needs the Docker engine: see .ci/run)
	$(PY) -m pytest -ra $(PYTEST_ARGS)

lint: $(PY) ## ruff, hadolint, shellcheck
	$(PY) -m ruff check .
	.venv/bin/hadolint Dockerfile $(wildcard docker/*/Dockerfile)
	.venv/bin/shellcheck entrypoint.sh .ci/run .ci/*.sh

smoke: $(PY) ## build FROM the stand-in (or BASE_IMAGE=<ROCm image> GPU=1), serve the tiny model, one request
	$(PY) -m k3rocm smoke $(if $(BASE_IMAGE),--base-image $(BASE_IMAGE)) $(if $(filter 1,$(GPU)),--gpu --profile $${K3_PROFILE:-cpu-smoke}) $(SMOKE_ARGS)

ci-images: $(PY) ## CI: both CPU stand-in bases (see mk/standin.mk), the client and router images, no pulls
	$(MAKE) standin
	$(MAKE) clients-image CLIENT_BASE=k3rocm/debian:bookworm
	$(MAKE) router-image ROUTER_BASE=k3rocm/debian:bookworm

-include mk/*.mk
