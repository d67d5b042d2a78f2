# syntax=docker/dockerfile:1
# A fedllm site engine on an NVIDIA GPU: `python -m site_engine`, configured by SITE_* variables
# (site_engine/settings.py). Build from the repository root:
#   docker build -f docker/site.Dockerfile -t fedllm-site:0.1.0 .
# Run (the entrypoint downloads the weights into SITE_MODEL_DIR once; see docker/site-entrypoint.sh):
#   docker run --gpus all -p 50051:50051 -v models:/models \
#     -e SITE_SITE_NAME=aws-use1 -e SITE_MODEL_NAME=qwen2.5-7b-instruct \
#     -e SITE_MODEL_DIR=/models/qwen2.5-7b-instruct/main \
#     -e FEDLLM_HF_REPO=Qwen/Qwen2.5-7B-Instruct -e FEDLLM_HF_REVISION=main \
#     -e SITE_TLS_CERT=... -e SITE_TLS_KEY=... -e SITE_TLS_CLIENT_CA=... fedllm-site:0.1.0
# Without the three SITE_TLS_* the engine refuses to listen on 0.0.0.0 (SITE_ALLOW_PLAINTEXT=true
# overrides that, for a network only the gateway reaches).
# The host needs the NVIDIA driver (>= 570 for CUDA 12.8) and the NVIDIA container toolkit.
FROM nvidia/cuda:12.8.1-base-ubuntu24.04 AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
RUN python3 -m venv /opt/fedllm
COPY pyproject.toml constraints.txt README.md ./
# torch at the version constraints.txt pins, built for the CUDA of the base image.
RUN /opt/fedllm/bin/pip install --index-url "$TORCH_INDEX_URL" \
      "torch==$(sed -n 's/^torch==//p' constraints.txt)"
COPY fedllm_contract fedllm_contract
COPY gateway gateway
COPY site_engine site_engine
COPY predictor predictor
COPY migrations migrations
RUN /opt/fedllm/bin/pip install -c constraints.txt ".[site]"

FROM nvidia/cuda:12.8.1-base-ubuntu24.04
ENV DEBIAN_FRONTEND=noninteractive
# Triton compiles its kernel launchers at run time: it needs a C compiler and Python's headers.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-dev gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --user-group --home-dir /models --no-create-home fedllm \
 && install -d -o fedllm -g fedllm -m 0750 /models
COPY --from=build /opt/fedllm /opt/fedllm
COPY --chmod=0755 docker/site-entrypoint.sh /usr/local/bin/fedllm-site-entrypoint
# The container runs with a read-only root: caches go to /tmp (tmpfs), weights to /models.
ENV PATH=/opt/fedllm/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HOME=/tmp/huggingface \
    XDG_CACHE_HOME=/tmp/cache \
    TRITON_CACHE_DIR=/tmp/triton \
    SITE_HOST=0.0.0.0 \
    SITE_PORT=50051 \
    SITE_DEVICE=cuda \
    SITE_DTYPE=bfloat16
WORKDIR /models
USER 10001:10001
EXPOSE 50051
VOLUME ["/models"]
# gRPC health (grpc.health.v1) of the engine on SITE_PORT. The start period covers the first
# download of the weights, which can take many minutes.
HEALTHCHECK --interval=30s --timeout=10s --start-period=30m --retries=3 \
  CMD ["python", "-m", "site_engine.healthcheck"]
ENTRYPOINT ["/usr/local/bin/fedllm-site-entrypoint"]
CMD ["python", "-m", "site_engine"]
