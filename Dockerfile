# syntax=docker/dockerfile:1
# The CPU image of `draftsmith serve-openai` (and, on request, `draftsmith serve`: tritonserver from the
# nvidia-pytriton wheel). Non-root; the bundle is NOT in it: mount it read-only at /bundle (the manifests of
# `draftsmith deploy kubernetes` do, from a PersistentVolumeClaim or an init container).
#
#   docker build -t draftsmith:cpu .                          # the OpenAI server
#   docker build -t draftsmith:dev --build-arg TRITON=1 .     # also tritonserver 2.51: development on loopback only
#
# tritonserver 2.51 (the newest the wheel ships) has unauthenticated crash/RCE CVEs fixed only in 2.59.1
# (docs/operations.md, "Security"), so it is left out by default and `deploy kubernetes` refuses to put it on a pod.
#   docker run --rm -p 8000:8000 -v $PWD/bundles/smollm2:/bundle:ro draftsmith:cpu \
#       serve-openai /bundle --host 0.0.0.0 --threads 2
#
# Not built on the machines this project is developed on (they have no container runtime); see docs/operations.md,
# "Scaling out", for what was and was not checked. What the binaries link against was checked with ldd there:
# tritonserver needs libz and libstdc++ beyond the wheel's own nvidia_pytriton.libs; the Python backend stub needs
# libpython3.11.so.1.0 (the official python images are built --enable-shared) and libexpat, all in this base.

FROM python:3.11-slim AS wheel
# a compiler and cmake for Draftsmith's GGUF kernel library (runtime/engines/gguf_ops), built here and shipped inside
# the wheel; its build fetches ONNX Runtime's API headers from Debian (libonnxruntime-dev, unpacked, not installed)
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends g++ cmake && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY runtime runtime
COPY triton_repo triton_repo
COPY bench bench
COPY deploy deploy
COPY builder builder
RUN rm -rf runtime/engines/gguf_ops/build && python -m runtime.engines.gguf_ops.build \
    && rm -rf runtime/engines/gguf_ops/build/cmake runtime/engines/gguf_ops/build/ort-headers \
    && pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11-slim
# 1: add tritonserver (nvidia-pytriton 0.7.0 ships Triton 2.51 and the Python backend stub for Python 3.11, the
# interpreter of this image); installed without its pins (numpy < 2 and tritonclient come from draftsmith's own).
# Never behind a port a network reaches (see above).
ARG TRITON=0
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 TOKENIZERS_PARALLELISM=false \
    OMP_NUM_THREADS=2 HOME=/work
RUN groupadd --gid 10001 draftsmith && useradd --uid 10001 --gid 10001 --home-dir /work --create-home draftsmith
COPY --from=wheel /wheels /wheels
RUN extras=serve; if [ "$TRITON" = "1" ]; then extras=serve,triton; fi \
    && pip install "$(ls /wheels/draftsmith-*.whl)[$extras]" \
    && if [ "$TRITON" = "1" ]; then pip install --no-deps nvidia-pytriton==0.7.0; fi \
    && rm -rf /wheels
USER 10001:10001
WORKDIR /work
EXPOSE 8000 8001 8002
ENTRYPOINT ["draftsmith"]
CMD ["--help"]
