"""The memory-bandwidth limit of `bench peers`: its arithmetic, the weight bytes a decode step
reads (dense and block-quantized), and a read bandwidth that is a real figure."""

from __future__ import annotations

import math

import pytest
import torch

from kvservice.client.bench.memory_bandwidth import BandwidthLimit, decode_weight_bytes, read_bandwidth
from kvservice.loading.model_files import TINY_CONFIG
from kvservice.loading.model_loader import load_model


def test_the_limit_is_bytes_over_bandwidth_in_ms_a_token() -> None:
    limit = BandwidthLimit(bytes_per_token=98_000_000, bandwidth=60e9, num_threads=2)
    assert limit.ms_per_token == pytest.approx(98 / 60)
    assert limit.describe() == "memory-bandwidth limit: 98.0 MB/token at 60.0 GB/s = 1.63 ms/token (2 threads)"
    assert limit.to_json() == {
        "weight_bytes_per_token": 98_000_000,
        "read_bandwidth_gb_s": 60.0,
        "num_threads": 2,
        "limit_ms_per_token": pytest.approx(1.6333, rel=1e-4),
    }


def test_a_dense_model_reads_every_matrix_and_norm_and_one_embedding_row() -> None:
    c = TINY_CONFIG
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    per_layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    norms = (2 * c.num_hidden_layers + 1) * c.hidden_size
    floats = c.num_hidden_layers * per_layer + c.vocab_size * c.hidden_size + norms + c.hidden_size
    assert decode_weight_bytes(load_model("tiny").model) == 4 * floats


def test_smollm2_reads_its_q4_1_layers_and_q8_0_head_a_token() -> None:
    # Per 32 weights: 16 bytes of 4-bit codes (Q4_1) or 32 of 8-bit ones (the Q8_0 LM head), a
    # float16 scale and a float16 min; the norms and the embedding row are float32.
    layers = 30 * 576 * (960 + 576 + 3072 + 1536)
    head = 49152 * 576
    expected = layers * (16 + 4) // 32 + head * (32 + 4) // 32 + (2 * 30 + 1) * 576 * 4 + 576 * 4
    assert decode_weight_bytes(load_model("smollm2").model) == expected  # 98.3 MB


def test_the_read_bandwidth_is_a_positive_finite_figure_and_leaves_torchs_threads_as_they_were() -> None:
    threads = torch.get_num_threads()
    bandwidth = read_bandwidth(num_threads=1, buffer_bytes=4 * 2**20, repeats=2)
    assert bandwidth > 0 and math.isfinite(bandwidth)
    assert torch.get_num_threads() == threads
