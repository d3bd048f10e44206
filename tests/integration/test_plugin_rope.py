# SPDX-License-Identifier: Apache-2.0
"""vToken's re-rotation (float64 angles, ``reclaim/rope.py``) against the GPT attention plugin's
own RoPE table (float32 angles, ``plugin_rope_double12.py``, built as TensorRT-LLM builds it): a
key the plugin wrote at position p + d and vToken turned back by d, against the key the plugin
would have written at p. Llama-3.1 RoPE (theta 500,000, Llama 3 scaling), head_dim 128; the
errors are recorded in docs/trtllm_engine.md."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.integration.plugin_rope_double12 import PluginRope, plugin_inv_freq
from trtllm_vtoken.reclaim.rope import RopeSpec, apply_rotation, rotation_at

LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}
SHIFT = 256  # tokens evicted before the key is turned back


def test_the_plugin_table_is_its_own_float32_arithmetic():
    """Its frequencies agree with vToken's to float32 rounding, but its angles are float32
    products (here exact only where the product is), not vToken's float64 ones."""
    spec = RopeSpec.from_scaling(128, 500000.0, LLAMA31)
    inv = plugin_inv_freq(128, 500000.0, LLAMA31)
    np.testing.assert_allclose(inv, spec.inv_freq().numpy(), rtol=1e-6)
    table = PluginRope(5000, 128, 500000.0, LLAMA31)
    angles = np.float32(4999) * inv
    np.testing.assert_array_equal(table.cos[4999].numpy(), np.cos(angles.astype(np.float32)))
    assert np.abs(angles.astype(np.float64) - 4999 * spec.inv_freq().double().numpy()).max() > 0


@pytest.mark.parametrize(("position", "documented"), [(4096, 3.2e-5), (32768, 3.8e-4), (131072, 8.8e-4)])
def test_rerotation_error_against_the_plugin_table(position, documented):
    """The largest relative error of a key turned back by SHIFT is what docs/trtllm_engine.md
    gives, to its two digits (within 3%: seeded keys, so only another library's float rounding
    moves it), each far below a bfloat16 rounding's 3.9e-3."""
    spec = RopeSpec.from_scaling(128, 500000.0, LLAMA31)
    table = PluginRope(position + SHIFT + 1, 128, 500000.0, LLAMA31)
    keys = torch.randn(256, 1, 128, generator=torch.Generator().manual_seed(position))
    written = table.rotate(keys, torch.full((256,), position + SHIFT))
    cos, sin = rotation_at(torch.tensor([-SHIFT]), spec, torch.float64)
    turned = apply_rotation(written, cos[:, None], sin[:, None], spec)
    want = table.rotate(keys, torch.full((256,), position))
    error = float(((turned - want).norm(dim=-1) / keys.norm(dim=-1)).max())
    print(f"\nposition {position}: re-rotated key vs the plugin's, largest relative error {error:.2e}")
    assert 0 < error < 3.9e-3 and error == pytest.approx(documented, rel=0.03)
