"""The benchmark's tokenizer: presets, a model directory, a tokenizer.json, and a name it cannot load."""

from __future__ import annotations

import pathlib

import pytest

from kvservice.client.bench.tokenizer import is_local_tokenizer, load_tokenizer
from kvservice.loading.tokenizer import ByteTokenizer, HFTokenizer


def test_tiny_is_the_byte_tokenizer() -> None:
    assert isinstance(load_tokenizer("tiny"), ByteTokenizer)
    assert is_local_tokenizer("tiny") and is_local_tokenizer("smollm2")


def test_a_model_directory_and_its_tokenizer_json_give_the_same_tokenizer(tokenizer_model_dir: pathlib.Path) -> None:
    by_dir, by_file = (
        load_tokenizer(str(tokenizer_model_dir)),
        load_tokenizer(str(tokenizer_model_dir / "tokenizer.json")),
    )
    assert isinstance(by_dir, HFTokenizer) and isinstance(by_file, HFTokenizer)
    text = "Hello, world"
    assert by_dir.encode(text) == by_file.encode(text) != ByteTokenizer().encode(text)
    assert is_local_tokenizer(str(tokenizer_model_dir))


def test_smollm2_loads_the_gguf_files_tokenizer() -> None:
    tokenizer = load_tokenizer("smollm2")
    ids = tokenizer.encode("Hello, world", add_special_tokens=False)
    assert 0 < len(ids) < len("Hello, world")  # a real vocabulary, not bytes
    assert tokenizer.decode(ids) == "Hello, world"


def test_a_name_that_is_neither_a_preset_nor_a_path_is_refused_naming_the_flag(tmp_path: pathlib.Path) -> None:
    assert not is_local_tokenizer("meta-llama/Llama-3.1-8B-Instruct")
    with pytest.raises(ValueError, match="^--tokenizer: .*meta-llama"):
        load_tokenizer("meta-llama/Llama-3.1-8B-Instruct")
    with pytest.raises(ValueError, match="^--tokenizer: .* has no tokenizer"):
        load_tokenizer(str(tmp_path))
