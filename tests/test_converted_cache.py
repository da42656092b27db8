"""A GGUF file converted once: later loads read the entry (no GGUF parsing) and build the
same model, tokenizer and config; a changed file, a damaged entry or the cache turned off
fall back to converting."""

from __future__ import annotations

import os
import pathlib

import pytest
import torch
from gguf_models import GGUFSpec, GGUFTokenizerSpec, random_state, sentencepiece_vocab, write_gguf

from kvservice import LLM, SamplingParams
from kvservice.loading import converted_cache, gguf_loader
from kvservice.loading.model_files import load_model_config, load_tokenizer
from kvservice.loading.model_loader import load_model

SPEC = GGUFSpec(arch="llama", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
TEXT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture
def cache(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> pathlib.Path:
    """A cache of its own that takes any file, however small."""
    root = tmp_path / "cache"
    monkeypatch.setenv("KVSERVICE_CACHE_DIR", str(root))
    monkeypatch.delenv("KVSERVICE_CONVERTED_CACHE", raising=False)
    monkeypatch.setattr(converted_cache, "MIN_CACHED_BYTES", 0)
    return root


@pytest.fixture
def gguf_file(tmp_path: pathlib.Path) -> pathlib.Path:
    tokens, types, merges = sentencepiece_vocab()
    tokenizer = GGUFTokenizerSpec(
        model="llama",
        tokens=tokens,
        token_types=types,
        merges=merges,
        bos_token_id=1,
        eos_token_id=2,
        unknown_token_id=0,
    )
    return write_gguf(
        tmp_path / "model.gguf", SPEC, random_state(SPEC, len(tokens), seed=3), "Q4_1", tokenizer=tokenizer
    )


def _forbid_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*_: object) -> None:
        raise AssertionError("the GGUF file was parsed although its converted entry exists")

    monkeypatch.setattr(gguf_loader, "open_gguf", fail)


def test_the_second_load_reads_the_entry_and_builds_the_same_model(
    cache: pathlib.Path, gguf_file: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = LLM(str(gguf_file))
    expected = first.generate([list(range(5, 40))], GREEDY)[0].token_ids
    config, tokenizer = load_model_config(str(gguf_file)), load_tokenizer(str(gguf_file))
    assert tokenizer is not None
    entry = converted_cache.entry_for(gguf_file)
    assert entry is not None and entry.parent.parent == cache
    assert {p.name for p in entry.iterdir()} == {
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "weights-float32.pt",
    }

    _forbid_parsing(monkeypatch)
    assert load_model_config(str(gguf_file)) == config
    again = load_tokenizer(str(gguf_file))
    assert again is not None and again.encode(TEXT) == tokenizer.encode(TEXT)
    assert again.decode(tokenizer.encode(TEXT)) == tokenizer.decode(tokenizer.encode(TEXT))
    second = LLM(str(gguf_file))
    assert second.generate([list(range(5, 40))], GREEDY)[0].token_ids == expected
    # The same weights, block-quantized copies included.
    loaded, reference = second.engine.core.loaded.model.state_dict(), first.engine.core.loaded.model.state_dict()
    assert loaded.keys() == reference.keys() and all(torch.equal(loaded[k], reference[k]) for k in reference)

    def blocks(llm: LLM) -> dict[str, torch.Tensor]:
        return {
            name: m.block_quant.dequantize()
            for name, m in llm.engine.core.loaded.model.named_modules()
            if getattr(m, "block_quant", None) is not None
        }

    cached_blocks, converted_blocks = blocks(second), blocks(first)
    assert len(converted_blocks) == 4 * SPEC.num_layers  # qkv, o, gate_up, down (this vocabulary is no multiple of 16)
    assert cached_blocks.keys() == converted_blocks.keys()
    assert all(torch.equal(cached_blocks[k], converted_blocks[k]) for k in converted_blocks)


def test_a_changed_file_is_converted_again(cache: pathlib.Path, gguf_file: pathlib.Path) -> None:
    load_model(str(gguf_file))
    old_entry = converted_cache.entry_for(gguf_file)
    stat = gguf_file.stat()
    os.utime(gguf_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    new_entry = converted_cache.entry_for(gguf_file)
    assert new_entry != old_entry and new_entry is not None and not new_entry.exists()
    load_model(str(gguf_file))
    assert (new_entry / "weights-float32.pt").is_file()


def test_a_damaged_entry_is_converted_again(
    cache: pathlib.Path, gguf_file: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    expected = load_model(str(gguf_file)).model.state_dict()
    entry = converted_cache.entry_for(gguf_file)
    assert entry is not None
    (entry / "weights-float32.pt").write_bytes(b"not a checkpoint")
    loaded = load_model(str(gguf_file)).model.state_dict()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)
    assert "unreadable" in caplog.text
    assert converted_cache.read_weights(entry, torch.float32) is not None  # written whole again


def test_each_dtype_has_its_own_weights(cache: pathlib.Path, gguf_file: pathlib.Path) -> None:
    load_model(str(gguf_file), dtype="bfloat16")
    entry = converted_cache.entry_for(gguf_file)
    assert (
        entry is not None and (entry / "weights-bfloat16.pt").is_file() and not (entry / "weights-float32.pt").exists()
    )
    state, _ = converted_cache.read_weights(entry, torch.bfloat16) or ({}, {})
    assert state and all(t.dtype == torch.bfloat16 for k, t in state.items() if k.endswith("proj.weight"))


def test_turned_off_or_small_files_write_nothing(
    cache: pathlib.Path, gguf_file: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVSERVICE_CONVERTED_CACHE", "0")
    load_model(str(gguf_file))
    assert converted_cache.entry_for(gguf_file) is None and not cache.exists()
    monkeypatch.delenv("KVSERVICE_CONVERTED_CACHE")
    monkeypatch.setattr(converted_cache, "MIN_CACHED_BYTES", gguf_file.stat().st_size + 1)
    load_model(str(gguf_file))
    assert converted_cache.entry_for(gguf_file) is None and not cache.exists()
