# GSM8K accuracy gate: lm-eval in the client container against the running server.
#   make gsm8k                         full test set, chat endpoint, gate 0.94
#   make gsm8k DRY_RUN=1               print the exact lm_eval command line, contact nothing
#   make gsm8k GSM8K_DATA=/data/gsm8k  air-gapped: a directory with train.jsonl and test.jsonl
#   make gsm8k GSM8K_ARGS='--limit 100 --concurrency 32'   any `k3rocm gsm8k` option
#   make gsm8k-data                    once, with HF hub access: openai/gsm8k into the HF cache
#   make gsm8k-ab [CPU=1]              the same items fusions off vs on, each arm on a fresh server
#                                      (= k3rocm ab --measure gsm8k): McNemar exact test and the gate
#                                      as non-inferiority (GSM8K_AB_ARGS='--margin 0.01 --limit 200')
# Server URL, model name, API key and results root come from the K3_* settings (shell, .env or
# `make gsm8k K3_PORT=...`). Exit codes (README "Exit codes"): 0 pass, 1 below the gate, 2 bad
# input, 3 server unreachable or no Docker engine, 130 interrupted; make reports that code as
# "Error N" (make's own exit status is 2 for any failure).
PY ?= .venv/bin/python
GSM8K_DATA ?=
GSM8K_ARGS ?=
GSM8K_AB_ARGS ?=

.PHONY: gsm8k gsm8k-data gsm8k-ab
gsm8k: $(PY) ## GSM8K 5-shot gate with lm-eval (DRY_RUN=1 prints the command; GSM8K_DATA, GSM8K_ARGS)
	$(PY) -m k3rocm gsm8k $(if $(GSM8K_DATA),--data-dir $(GSM8K_DATA)) $(if $(filter 1,$(DRY_RUN)),--dry-run) $(GSM8K_ARGS)

gsm8k-data: $(PY) ## download openai/gsm8k once into the HF cache (needs hub access; GSM8K_ARGS=--hf-home DIR)
	$(PY) -m k3rocm gsm8k --fetch-data $(GSM8K_ARGS)

gsm8k-ab: $(PY) ## GSM8K fusions off vs on on the same items, fresh server per arm (CPU=1, GSM8K_DATA, GSM8K_AB_ARGS)
	$(PY) -m k3rocm ab --measure gsm8k $(if $(GSM8K_DATA),--data-dir $(GSM8K_DATA)) $(if $(filter 1,$(CPU)),--no-gpu) $(if $(filter 1,$(DRY_RUN)),--dry-run) $(GSM8K_AB_ARGS)
