"""The memory-bandwidth limit of single-stream decoding: the weight bytes one generated token
reads over the bandwidth this machine's cores read memory at, in ms a token.

A decode step at concurrency 1 reads every weight it multiplies by once, and SmolLM2 is too big
for the caches (about 98 MB as Q4_1 codes, more than the L3 of the 2-core VMs the benchmarks
run on), so no TPOT can go below bytes / bandwidth; `bench peers` holds kvservice's TPOT at c=1
against a multiple of it (issue #50). The bandwidth is what `torch` reads summing a float32
buffer far larger than any cache, with the threads the servers compute with, best of a few
passes: the same "plain sum" `scripts/attention_rates.py` sets kernels against.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from kvservice.model.model import CausalLM, Linear, RMSNorm

DEFAULT_BUFFER_BYTES = 512 * 2**20  # 16x a 32 MiB L3: what is read comes from DRAM
DEFAULT_REPEATS = 10
_MB, _GB = 1e6, 1e9


@dataclass(frozen=True, slots=True)
class BandwidthLimit:
    """`bytes_per_token` read at `bandwidth` bytes/s by `num_threads` threads."""

    bytes_per_token: int
    bandwidth: float
    num_threads: int

    @property
    def ms_per_token(self) -> float:
        """The fastest a token can be generated when every weight byte comes from memory."""
        return 1e3 * self.bytes_per_token / self.bandwidth

    def describe(self) -> str:
        return (
            f"memory-bandwidth limit: {self.bytes_per_token / _MB:.1f} MB/token at {self.bandwidth / _GB:.1f} GB/s "
            f"= {self.ms_per_token:.2f} ms/token ({self.num_threads} threads)"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "weight_bytes_per_token": self.bytes_per_token,
            "read_bandwidth_gb_s": self.bandwidth / _GB,
            "num_threads": self.num_threads,
            "limit_ms_per_token": self.ms_per_token,
        }


def decode_weight_bytes(model: CausalLM) -> int:
    """The weight bytes one decode step of one sequence reads from `model`.

    Every `Linear` (each layer's projections and the LM head) counts its block-quantized codes,
    scales and mins where it has them (what `block_quant_linear` reads in a server, whose kernels
    are loaded), else its weight as loaded, plus its bias; every RMSNorm counts its weight; the
    embedding counts the one row the token looks up (a tied LM head reads its own block-quantized
    copy). Not counted: the KV cache, which grows with the context (float32 SmolLM2: 46 KB a token
    of context, ~18 MB at bench peers' 384 tokens) and the rotary tables' row, so the limit is a floor.
    """
    total = 0
    for module in model.modules():
        if isinstance(module, Linear):
            weight = module.block_quant
            tensors = [module.weight] if weight is None else [weight.codes, weight.scales, weight.mins]
            total += sum(_nbytes(t) for t in [*tensors, *([] if module.bias is None else [module.bias])])
        elif isinstance(module, RMSNorm):
            total += _nbytes(module.weight)
    embedding = model.model.embed_tokens.weight
    return total + embedding.shape[1] * embedding.element_size()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def read_bandwidth(num_threads: int, buffer_bytes: int = DEFAULT_BUFFER_BYTES, repeats: int = DEFAULT_REPEATS) -> float:
    """Bytes/s that `num_threads` torch threads read summing a float32 buffer of `buffer_bytes`:
    the fastest of `repeats` passes after one that warms up (its pages are written before)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        buffer = torch.ones(max(buffer_bytes // 4, 1), dtype=torch.float32)
        buffer.sum()
        fastest = math.inf
        for _ in range(repeats):
            start = time.perf_counter()
            buffer.sum()
            fastest = min(fastest, time.perf_counter() - start)
        return _nbytes(buffer) / fastest
    finally:
        torch.set_num_threads(previous)


def measure_limit(model: str, num_threads: int, buffer_bytes: int = DEFAULT_BUFFER_BYTES) -> BandwidthLimit:
    """Load `model` as the servers do to count its bytes a token, drop it, then time the read bandwidth."""
    from kvservice.loading.model_loader import load_model

    bytes_per_token = decode_weight_bytes(load_model(model).model)  # freed before the buffer is made
    return BandwidthLimit(bytes_per_token, read_bandwidth(num_threads, buffer_bytes), num_threads)
