# SPDX-License-Identifier: Apache-2.0
"""Serving through Triton Inference Server: request protocol, the engine loop, metrics, and the
server launcher. Nothing here imports Triton's Python modules; ``triton_model_repo`` does."""
