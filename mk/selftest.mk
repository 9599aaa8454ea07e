# Selftest: before the 1.5 TB load, the real serving path on a small Kimi-K3-shaped checkpoint
# (same image, compose service, entrypoint, profile, settings, overlay). See docs/selftest.md.
#   make selftest-model                  cut <K3_MODELS_DIR>/Kimi-K3-selftest from K3_MODEL's
#                                        checkpoint (headers only; SELFTEST_MODEL_ARGS=)
#   make selftest                        check first (client image, port, GPUs free, base),
#                                        build, serve it on K3_PORT+1, census, greedy logprobs
#                                        fusions on vs off, a bench point, summary; the servers
#                                        get this shell's vendor variables (not .k3rocm/vendor.env)
#   make selftest CPU=1                  the same steps on the CPU stand-in (tiny smoke model)
PY ?= .venv/bin/python
SELFTEST_ARGS ?=
SELFTEST_MODEL_ARGS ?=

.PHONY: selftest selftest-model

selftest: $(PY) ## small Kimi-K3-shaped model through the real serving path: census, greedy off/on, bench (SELFTEST_ARGS=)
	@$(CONFIG_ENV) $(PY) -m k3rocm selftest run $(SELFTEST_ARGS)

selftest-model: $(PY) ## cut a small Kimi-K3-shaped checkpoint from yours (headers only; SELFTEST_MODEL_ARGS=)
	$(PY) -m k3rocm selftest model $(SELFTEST_MODEL_ARGS)
