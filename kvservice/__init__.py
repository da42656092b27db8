"""kvservice: disaggregated prefill/decode LLM serving with the KV cache streamed over gRPC."""

from __future__ import annotations

from kvservice.llm import LLM
from kvservice.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
