# SPDX-License-Identifier: Apache-2.0
"""Tensor parallelism for the reference runtime, on ``torch.distributed`` (gloo on CPU, NCCL on
CUDA): how the model splits (``partition``), the sharded layers (``layers``), the ranks' process
group (``torch_ranks``), what a rank process runs (``rank_process``), how the caller drives
the ranks (``launch``) and when it may start them (``main_guard``). The decisions the ranks must share are kept identical by
``trtllm_vtoken.consistency``."""
