# The Kimi-K3 serving image: a vLLM ROCm release (default v0.34.0, the newest; docs/profiles.md)
# + our package + the AMD MLA overlay where upstream lacks a fusion.
# Build:  make build  (or: docker compose build; docker build --build-arg BASE_IMAGE=<image> .)
# BASE_DIGEST: the base's registry digest, known only on the host once pulled (`make build` passes
# `docker image inspect --format '{{index .RepoDigests 0}}' $BASE_IMAGE`); recorded in the manifest.
# Layers are ordered so that an edit to overlay/ or src/ rebuilds in seconds.
ARG BASE_IMAGE=vllm/vllm-openai-rocm:v0.34.0
FROM ${BASE_IMAGE}

ARG BASE_IMAGE
ARG BASE_DIGEST=
ARG K3_OVERLAY=auto
ARG GIT_REV=unknown

LABEL org.opencontainers.image.title="k3rocm-server" \
      org.opencontainers.image.description="Kimi-K3 on vLLM ROCm with the AMD MLA fusion overlay" \
      org.opencontainers.image.base.name="${BASE_IMAGE}" \
      org.opencontainers.image.base.digest="${BASE_DIGEST}" \
      org.opencontainers.image.revision="${GIT_REV}"

COPY entrypoint.sh /opt/k3rocm/entrypoint.sh

# Our package: pure Python, no dependencies beyond pydantic (which vLLM already has); installed
# offline (no index) into the image's own Python, next to vLLM.
COPY pyproject.toml /opt/k3rocm/pkg/pyproject.toml
COPY src/ /opt/k3rocm/pkg/src/
RUN PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-cache-dir --no-deps --no-index \
        --no-build-isolation --disable-pip-version-check /opt/k3rocm/pkg \
    && rm -rf /opt/k3rocm/pkg/build \
    && python3 -m k3rocm --version

# The overlay (vllm/models/kimi_k3/amd/...), applied into vLLM's tree with checks, then the
# provenance manifest (base image, vLLM version, our revision, overlay hashes and decision).
COPY overlay/ /opt/k3rocm/overlay/
RUN python3 -m k3rocm overlay apply --overlay-dir /opt/k3rocm/overlay --mode "${K3_OVERLAY}" \
        --report /opt/k3rocm/overlay.json \
    && python3 -m k3rocm overlay verify-import \
    && python3 -m k3rocm manifest write --base-image "${BASE_IMAGE}" --base-digest "${BASE_DIGEST}" \
        --git-rev "${GIT_REV}" \
        --overlay-dir /opt/k3rocm/overlay --overlay-report /opt/k3rocm/overlay.json \
        --out /opt/k3rocm/manifest.json

HEALTHCHECK --interval=30s --timeout=10s --start-period=60m --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % (os.environ.get('K3_PORT') or 8000), timeout=8)"]

ENTRYPOINT ["/opt/k3rocm/entrypoint.sh"]
CMD []
