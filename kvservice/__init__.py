"""kvservice: disaggregated prefill/decode LLM serving with the KV cache streamed over gRPC.

`LLM` and `SamplingParams` load on first use (PEP 562), so the processes that never run a
model (`kvservice health`, `stats`, the proxy, a container's health check) do not pay for
importing torch.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvservice.core.sampling_params import SamplingParams
    from kvservice.engine.llm import LLM

try:
    __version__ = importlib.metadata.version("kvservice")
except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["LLM", "SamplingParams", "__version__"]

_LAZY = {"LLM": "kvservice.engine.llm", "SamplingParams": "kvservice.core.sampling_params"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kvservice' has no attribute {name!r}")
