# syntax=docker/dockerfile:1
#
# The gradient-inspector demo in a container: a built-in scenario trains and the dashboard
# serves on port 8000.
#
#   docker build -t gradient-inspector .                       # CPU: the default (last) stage
#   docker build --target cuda -t gradient-inspector:cuda .    # GPU boxes: official PyTorch CUDA runtime
#   docker run --rm -p 8000:8000 -v gi-data:/data gradient-inspector
#   docker run --rm --gpus all -p 8000:8000 -v gi-data:/data gradient-inspector:cuda
#
# Inside a container the server binds 0.0.0.0, so it requires a token: one is generated at each
# start and printed in the URL to open (`docker logs`): http://127.0.0.1:8000/?token=...
# Arguments replace the command after `gradient-inspector`, e.g. a scenario and a fixed token:
#   docker run --rm -p 8000:8000 -v gi-data:/data gradient-inspector \
#       demo --host 0.0.0.0 --port 8000 --db /data/gradient-inspector.sqlite --scenario exploding --token T
# History lives in the /data volume; each start is a new run in it (`replay`/`export` read it).

ARG PYTHON_VERSION=3.11
ARG TORCH_VERSION=2.13.0
# An official PyTorch image with CUDA (torch already installed). Pick a tag your driver supports:
# https://hub.docker.com/r/pytorch/pytorch/tags
ARG CUDA_IMAGE=pytorch/pytorch:2.13.0-cuda12.8-cudnn9-runtime

# ---- the wheel, built once for both variants (the dashboard is static files: no frontend build)
FROM python:${PYTHON_VERSION}-slim AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY inspector ./inspector
COPY server ./server
COPY frontend ./frontend
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---- GPU: `docker build --target cuda`. The base image's torch is kept: pip is constrained to it.
FROM ${CUDA_IMAGE} AS cuda
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=wheel /wheels /tmp/wheels
RUN python -c "import torch; print('torch==' + torch.__version__)" > /tmp/keep-torch.txt \
    && pip install --no-cache-dir --constraint /tmp/keep-torch.txt /tmp/wheels/*.whl \
    && rm -rf /tmp/wheels /tmp/keep-torch.txt
# a non-root user, numeric so that the host and Kubernetes' runAsNonRoot can tell
RUN groupadd --gid 10001 inspector \
    && useradd --no-log-init --create-home --uid 10001 --gid 10001 inspector \
    && mkdir /data \
    && chown 10001:10001 /data
USER 10001:10001
WORKDIR /home/inspector
VOLUME ["/data"]
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import json, sys, urllib.request; r = urllib.request.urlopen('http://127.0.0.1:8000/api/health', timeout=4); sys.exit(json.load(r).get('status') != 'ok')"]
ENTRYPOINT ["gradient-inspector"]
CMD ["demo", "--host", "0.0.0.0", "--port", "8000", "--db", "/data/gradient-inspector.sqlite"]

# ---- CPU, the default target: torch's CPU build from the PyTorch index (PyPI's torch is the CUDA one)
FROM python:${PYTHON_VERSION}-slim AS cpu
ARG TORCH_VERSION
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}"
COPY --from=wheel /wheels /tmp/wheels
RUN python -c "import torch; print('torch==' + torch.__version__)" > /tmp/keep-torch.txt \
    && pip install --no-cache-dir --constraint /tmp/keep-torch.txt /tmp/wheels/*.whl \
    && rm -rf /tmp/wheels /tmp/keep-torch.txt
# a non-root user, numeric so that the host and Kubernetes' runAsNonRoot can tell
RUN groupadd --gid 10001 inspector \
    && useradd --no-log-init --create-home --uid 10001 --gid 10001 inspector \
    && mkdir /data \
    && chown 10001:10001 /data
USER 10001:10001
WORKDIR /home/inspector
VOLUME ["/data"]
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import json, sys, urllib.request; r = urllib.request.urlopen('http://127.0.0.1:8000/api/health', timeout=4); sys.exit(json.load(r).get('status') != 'ok')"]
ENTRYPOINT ["gradient-inspector"]
CMD ["demo", "--host", "0.0.0.0", "--port", "8000", "--db", "/data/gradient-inspector.sqlite"]
