# Kimi-K3 AMD MLA overlay. See docs/overlay.md.
#   make overlay-test                  overlay tests (real vLLM in the stand-in images, real Docker)
#   make overlay-status [IMAGE=...]    what the image's overlay report and manifest say
#   make overlay-invllm VLLM_PY=/path/to/venv/bin/python   in-vLLM checks in a local vLLM venv
PY ?= .venv/bin/python
IMAGE ?= k3rocm/server:latest
VLLM_PY ?=

.PHONY: overlay-test overlay-status overlay-invllm

overlay-test: $(PY) ## overlay: apply/wiring/numerics/e2e tests (Docker + stand-in images)
	$(PY) -m pytest -q tests/test_overlay_apply.py tests/test_overlay_standin.py \
	  tests/test_overlay_image.py

overlay-status: ## overlay: show IMAGE's overlay decision, hashes and wiring (IMAGE=...)
	docker run --rm --entrypoint python3 $(IMAGE) -m k3rocm overlay status
	docker run --rm --entrypoint cat $(IMAGE) /opt/k3rocm/overlay.json

overlay-invllm: ## overlay: run tests/overlay_invllm in a local vLLM venv (VLLM_PY=...)
	@test -n "$(VLLM_PY)" || { echo "set VLLM_PY=<python of a venv with vLLM>"; exit 2; }
	VLLM_TARGET_DEVICE=cpu $(VLLM_PY) -m pytest -q -p no:cacheprovider \
	  -o python_files='check_*.py' tests/overlay_invllm
