"""The transformer and its kernels: Llama-family model, paged attention, KV cache tensors.

Plain PyTorch with optional C++ CPU kernels (`csrc/`, built on first use). The model sees
a KV connector only through its two per-layer hooks (`LayerKVHooks`).
"""
