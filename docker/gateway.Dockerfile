# syntax=docker/dockerfile:1
# The fedllm gateway: `python -m gateway`, configured by GATEWAY_* variables (gateway/settings.py).
# Build from the repository root:
#   docker build -f docker/gateway.Dockerfile -t fedllm-gateway:0.1.0 .
# Run (the entrypoint turns FEDLLM_* variables into files; see docker/gateway-entrypoint.sh):
#   docker run -p 8000:8000 -e GATEWAY_DATABASE_URL=postgresql+psycopg://... \
#     -e FEDLLM_FEDERATION_JSON="$(cat federation.json)" -e FEDLLM_MODELS='{...}' fedllm-gateway:0.1.0
# The dashboard's chart library, from the npm registry at build time (never committed, no CDN).
FROM node:20-bookworm-slim AS ui
WORKDIR /ui
COPY gateway/admin_ui/package.json gateway/admin_ui/package-lock.json ./
RUN npm ci --no-audit --no-fund --loglevel=error

FROM python:3.11-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python -m venv /opt/fedllm
COPY pyproject.toml constraints.txt README.md ./
# The gateway never runs a model: it installs the project's core dependencies only, no torch and
# no site engine (docs/architecture.md: the image's size before and after that split).
COPY fedllm_contract fedllm_contract
COPY gateway gateway
COPY --from=ui /ui/node_modules gateway/admin_ui/node_modules
COPY predictor predictor
COPY migrations migrations
RUN /opt/fedllm/bin/pip install -c constraints.txt .

# `docker build --target trainer`: the retrain command (python -m gateway.retrain_predictor)
# fine-tunes predictors, which needs torch (from the CPU wheel index) and the training extras.
FROM build AS build-trainer
RUN /opt/fedllm/bin/pip install --index-url https://download.pytorch.org/whl/cpu \
      "torch==$(sed -n 's/^torch==//p' constraints.txt)" \
 && /opt/fedllm/bin/pip install -c constraints.txt ".[train]"

# The ECS retraining task (infra/terraform, trainer_image) mounts the same state, /tmp and predictor
# paths as the gateway, on a read-only root file system: the same directories, owner and volumes.
FROM python:3.11-slim-bookworm AS trainer
RUN useradd --system --uid 10001 --user-group --home-dir /var/lib/fedllm --no-create-home fedllm \
 && install -d -o fedllm -g fedllm -m 0750 /var/lib/fedllm /srv/fedllm/predictor
COPY --from=build-trainer /opt/fedllm /opt/fedllm
ENV PATH=/opt/fedllm/bin:$PATH PYTHONUNBUFFERED=1 HF_HOME=/tmp/huggingface ORT_DISABLE_TELEMETRY=1
WORKDIR /var/lib/fedllm
USER 10001:10001
VOLUME ["/var/lib/fedllm", "/tmp"]
CMD ["python", "-m", "gateway.retrain_predictor", "--help"]

# The serving gateway (the default target: the last stage).
FROM python:3.11-slim-bookworm
# uid 10001 owns the state directory and the predictor mount; the ECS task's EFS access point
# uses the same uid. VOLUME lets Fargate copy these directories, with their owner, into task storage.
RUN useradd --system --uid 10001 --user-group --home-dir /var/lib/fedllm --no-create-home fedllm \
 && install -d -o fedllm -g fedllm -m 0750 /var/lib/fedllm /srv/fedllm/predictor
COPY --from=build /opt/fedllm /opt/fedllm
COPY --chmod=0755 docker/gateway-entrypoint.sh /usr/local/bin/fedllm-gateway-entrypoint
ENV PATH=/opt/fedllm/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HOME=/tmp/huggingface \
    ORT_DISABLE_TELEMETRY=1 \
    GATEWAY_HOST=0.0.0.0 \
    GATEWAY_PORT=8000 \
    GATEWAY_FEDERATION_FILE=/var/lib/fedllm/federation.json
WORKDIR /var/lib/fedllm
USER 10001:10001
EXPOSE 8000
VOLUME ["/var/lib/fedllm", "/tmp"]
# Liveness (/healthz): the process serves HTTP. Readiness (/readyz: database and at least one
# healthy site) is for operators and deploy checks; an outage of every site must not get the
# gateway restarted.
HEALTHCHECK --interval=30s --timeout=10s --start-period=5m --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('GATEWAY_PORT', '8000') + '/healthz', timeout=5)"]
ENTRYPOINT ["/usr/local/bin/fedllm-gateway-entrypoint"]
CMD ["python", "-m", "gateway"]
