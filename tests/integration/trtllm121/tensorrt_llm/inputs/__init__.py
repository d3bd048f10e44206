# SPDX-License-Identifier: Apache-2.0
"""Double of ``tensorrt_llm.inputs``."""
