# The Kimi-K3 checkpoint: download at the pinned revision, or verify a copy.
#   make model                  download into $(K3_MODELS_DIR)/Kimi-K3 (resumable: finished files
#                               are kept; run it again after an interruption)
#   make model DRY_RUN=1        list what would be fetched and the disk it needs, fetch nothing
#   make model VERIFY=1         verify the copy there: config.json, every indexed shard's header
#                               against its file size, the sum against the index's total_size
#                               (headers only; missing, short and extra shards named; exit 1)
#   make model MODEL_ARGS='--revision <40-hex> --max-workers 16'   any `k3rocm model` option
# Gated or private: HF_TOKEN in the shell. The revision and sha256 of config.json and of the
# safetensors index go into provenance (k3rocm.deploy.checkpoint.identity).
PY ?= .venv/bin/python
MODEL_ARGS ?=

.PHONY: model
model: $(PY) ## download Kimi-K3 at the pinned revision into K3_MODELS_DIR, or verify it (VERIFY=1, DRY_RUN=1, MODEL_ARGS)
	$(PY) -m k3rocm model $(if $(filter 1,$(VERIFY)),--verify) $(if $(filter 1,$(DRY_RUN)),--dry-run) $(MODEL_ARGS)
