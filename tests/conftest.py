"""Shared fixtures: random tiny Hugging Face checkpoints, written once per session."""

from __future__ import annotations

import pathlib
from collections.abc import Callable

import pytest
import torch
from hf_models import save_random_model

# The test models are tiny: with several intra-op threads on a small, shared CPU the
# threads' fan-out costs far more than the arithmetic (and swings wildly under load).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], pathlib.Path]:
    """`hf_model_dir(kind)`: the directory of a random `kind` checkpoint (built on first use)."""
    root = tmp_path_factory.mktemp("hf_models")
    built: dict[str, pathlib.Path] = {}

    def get(kind: str) -> pathlib.Path:
        if kind not in built:
            built[kind] = save_random_model(kind, root / kind)
        return built[kind]

    return get


@pytest.fixture(scope="session")
def llama_dir(hf_model_dir: Callable[[str], pathlib.Path]) -> pathlib.Path:
    """Llama, untied lm_head, GQA (4 heads / 2 KV heads), llama3 rope scaling."""
    return hf_model_dir("llama")


@pytest.fixture(scope="session")
def llama_tied_dir(hf_model_dir: Callable[[str], pathlib.Path]) -> pathlib.Path:
    """Llama, tied embeddings, MHA (4 heads / 4 KV heads)."""
    return hf_model_dir("llama_tied")


@pytest.fixture(scope="session")
def qwen2_dir(hf_model_dir: Callable[[str], pathlib.Path]) -> pathlib.Path:
    """Qwen2: q/k/v biases, tied embeddings."""
    return hf_model_dir("qwen2")


@pytest.fixture(scope="session")
def mistral_dir(hf_model_dir: Callable[[str], pathlib.Path]) -> pathlib.Path:
    """Mistral without a sliding window."""
    return hf_model_dir("mistral")


@pytest.fixture(scope="session")
def tokenizer_model_dir(hf_model_dir: Callable[[str], pathlib.Path]) -> pathlib.Path:
    """The `llama` shape plus a byte-level BPE tokenizer.json."""
    return hf_model_dir("llama_tokenizer")
