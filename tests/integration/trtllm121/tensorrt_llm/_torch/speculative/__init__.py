# SPDX-License-Identifier: Apache-2.0
"""Double of ``tensorrt_llm._torch.speculative``: the NGram drafter only."""
