"""kvservice: disaggregated prefill/decode LLM serving with the KV cache streamed over gRPC."""

from __future__ import annotations

import importlib.metadata

from kvservice.core.sampling_params import SamplingParams
from kvservice.engine.llm import LLM

try:
    __version__ = importlib.metadata.version("kvservice")
except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["LLM", "SamplingParams", "__version__"]
