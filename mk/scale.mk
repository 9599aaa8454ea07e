# Scale-out beyond one node (docs/scale.md) and the node preflight (docs/preflight.md).
#   make preflight                 one table: what this node has and needs (exit 1 on a fail)
#   make router-image              k3rocm/router:0.1.17 offline from the hashed wheel lock
#   make router-up / router-down   vllm-router in front of K3_SCALE_NODES (K3_SCALE_MODE=replicas);
#                                  ROUTER=2: a second router (port +1); router-down drains
#   make status                    one line per replica + the router's view ("degraded, 1 of 2")
#   make router-overhead           the router's added latency vs direct requests, one run (ratio)
#   make router-proxy-conf         nginx config exposing only the router's data paths
#   make scale-render [OUT=dir]    per-node env/argv (+ compose overrides nodeN.yaml in OUT)
#   make render-k8s [OUT=file]     Kubernetes manifests, checked against the K8s schemas
#   make k8s-check                 strict schemas 1.29-1.37 offline; with a kubeconfig also
#                                  kubectl apply --dry-run=server
#   make bench-router / gsm8k-router   `make bench`/`make gsm8k` against the router (same
#                                  WORKLOAD/BENCH_ARGS/GSM8K_ARGS; provenance gets a topology block)
# Settings: K3_SCALE_* in the shell or .env, like every K3_* setting (`k3rocm scale config`).
PY ?= .venv/bin/python
ROUTER_VERSION ?= 0.1.17
ROUTER_IMAGE ?= $(or $(K3_SCALE_ROUTER_IMAGE),k3rocm/router:$(ROUTER_VERSION))
ROUTER_BASE ?= k3rocm/debian:bookworm
ROUTER_LOCK := docker/router/requirements.lock
# Like CLIENT_WHEELS (mk/bench.mk): one directory per lock content, outside the checkout.
ROUTER_WHEELS ?= $(K3ROCM_CACHE)/wheels/router-$(shell sha256sum $(ROUTER_LOCK) | cut -c1-16)
PREFLIGHT_ARGS ?=
OUT ?=

.PHONY: router-overhead router-proxy-conf bench-router gsm8k-router preflight router-wheels router-image router-up router-down status scale-render render-k8s k8s-check scale-test

preflight: $(PY) ## node preflight: ROCm devices, groups, NUMA, disk, checkpoint, image, ports, Docker (+ scale-out checks)
	$(PY) -m k3rocm preflight $(PREFLIGHT_ARGS)

# Wheels for CPython 3.11 manylinux x86_64 (the router image's Debian 12 python3), each checked
# against the sha256 in the lock; any host Python can download them.
$(ROUTER_WHEELS)/.complete: | $(PY)
	mkdir -p $(ROUTER_WHEELS)
	$(PY) -m pip download --quiet --no-deps --require-hashes --only-binary :all: \
	  --python-version 3.11 --implementation cp --abi cp311 --abi abi3 --abi none \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
	  --platform manylinux1_x86_64 --platform any \
	  -d $(ROUTER_WHEELS) -r $(ROUTER_LOCK)
	cp $(ROUTER_LOCK) $(ROUTER_WHEELS)/requirements.lock
	touch $@

router-wheels: $(ROUTER_WHEELS)/.complete ## download the router's locked wheels on the host

router-image: $(ROUTER_WHEELS)/.complete ## build the vllm-router image offline (FROM k3rocm/debian:bookworm)
	docker build -f docker/router/Dockerfile --build-arg ROUTER_BASE=$(ROUTER_BASE) \
	  --build-arg VLLM_ROUTER_VERSION=$(ROUTER_VERSION) -t $(ROUTER_IMAGE) $(ROUTER_WHEELS)

router-up: $(PY) ## start vllm-router in front of K3_SCALE_NODES (ROUTER=N: instance N, port +N-1)
	$(PY) -m k3rocm scale router-up $(if $(ROUTER),--instance $(ROUTER))

router-down: $(PY) ## drain (in-flight requests finish), stop and remove the router (ROUTER=N, ROUTER_TIMEOUT=s)
	$(PY) -m k3rocm scale router-down $(if $(ROUTER),--instance $(ROUTER)) $(if $(ROUTER_TIMEOUT),--timeout $(ROUTER_TIMEOUT))

status: $(PY) ## one line per replica (health, model, fusions, image) and the router's view
	$(PY) -m k3rocm scale status

router-overhead: $(PY) ## router added latency vs direct requests in one run (OVERHEAD_ARGS=-n 48)
	$(PY) -m k3rocm scale overhead $(OVERHEAD_ARGS)

router-proxy-conf: $(PY) ## nginx config that exposes only the router's /v1/* and health paths
	@$(PY) -m k3rocm scale proxy-conf $(PROXY_ARGS)

scale-render: $(PY) ## per-node env/argv for K3_SCALE_MODE (OUT=dir: compose overrides nodeN.yaml)
	$(PY) -m k3rocm scale render $(if $(OUT),--out $(OUT))

render-k8s: $(PY) ## Kubernetes manifests for K3_SCALE_MODE, checked against the K8s schemas (OUT=file)
	$(PY) -m k3rocm scale render-k8s $(if $(OUT),--out $(OUT))

k8s-check: $(PY) ## the manifests checked as a cluster would (offline schemas; kubectl dry-run with a kubeconfig)
	$(PY) -m k3rocm scale k8s-check

bench-router: $(PY) ## make bench through the router of K3_SCALE_* (WORKLOAD=, BENCH_ARGS=)
	@url=$$($(PY) -m k3rocm scale url) || exit 2; \
	  set -x; $(PY) -m k3rocm bench --workload $(or $(WORKLOAD),decode-8k1k) --url $$url $(BENCH_ARGS)

gsm8k-router: $(PY) ## make gsm8k through the router of K3_SCALE_* (GSM8K_ARGS=)
	@url=$$($(PY) -m k3rocm scale url) || exit 2; \
	  set -x; $(PY) -m k3rocm gsm8k --url $$url $(GSM8K_ARGS)

scale-test: $(PY) ## scale/preflight tests (the live ones start 2 stand-in servers + the router)
	$(PY) -m pytest -ra tests/test_scale_unit.py tests/test_k8s_render.py tests/test_preflight.py tests/test_scale_standin.py $(PYTEST_ARGS)
