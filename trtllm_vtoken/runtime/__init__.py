# SPDX-License-Identifier: Apache-2.0
"""The torch reference paged runtime: KV pool + block-offsets table, paged attention, Llama model."""
