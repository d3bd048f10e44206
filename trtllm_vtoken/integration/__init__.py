# SPDX-License-Identifier: Apache-2.0
"""Adapters that host vToken inside serving runtimes (``trtllm``: TensorRT-LLM's PyTorch backend)."""
