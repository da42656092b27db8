"""GGUF files load to the weights, the tokenizer and the greedy output the reference gets.

References: the `gguf` package's own dequantization (weights), transformers' GGUF loading
(SmolLM2's tokens and greedy output), and the same random model saved as a Hugging Face
directory (greedy output through kvservice and transformers).
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf_models import (
    QUANTIZABLE_TYPES,
    RAW_BLOCK_TYPES,
    GGUFSpec,
    GGUFTokenizerSpec,
    byte_level_vocab,
    permute_qk,
    random_state,
    sentencepiece_vocab,
    spec_of,
    write_gguf,
)
from hf_models import TOKENIZER_CORPUS, hf_greedy, random_prompts

from kvservice import LLM, SamplingParams
from kvservice.loading.gguf_loader import open_gguf
from kvservice.loading.gguf_tokenizer import gguf_tokenizer
from kvservice.loading.model_files import load_model_config
from kvservice.loading.model_loader import ModelLoadError, load_model

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


# ------------------------------------------------------------ quantization types

# Every matrix is 256 wide, the K-quants' block size.
QUANT_SPEC = GGUFSpec(arch="llama", hidden_size=256, intermediate_size=256, num_layers=1, num_heads=4, num_kv_heads=2)
QUANT_VOCAB = 256


def reference_weights(path: pathlib.Path) -> dict[str, np.ndarray]:
    """Every tensor dequantized by the `gguf` package itself, in PyTorch's shape."""
    reader = gguf.GGUFReader(path)
    return {
        # A copy: F32 tensors come back as read-only views of the mapped file.
        t.name: np.array(
            gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(int(n) for n in reversed(t.shape)))
        )
        for t in reader.tensors
    }


# Random K-quant blocks hold a few inf/NaN float16 scales: the package warns as it decodes them.
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("qtype", [*QUANTIZABLE_TYPES, *RAW_BLOCK_TYPES])
def test_every_quantization_type_loads_to_the_packages_dequantization(tmp_path: pathlib.Path, qtype: str) -> None:
    state = random_state(QUANT_SPEC, QUANT_VOCAB, seed=3)
    path = write_gguf(tmp_path / f"{qtype}.gguf", QUANT_SPEC, state, qtype)
    reader = gguf.GGUFReader(path)
    assert reader.tensors[-1].tensor_type.name == qtype  # the file really holds that type
    ref = reference_weights(path)
    loaded = load_model(str(path)).model.state_dict()

    # q/k back in Hugging Face's order: llama.cpp's order is the reference permuted.
    q, k, v = loaded["model.layers.0.self_attn.qkv_proj.weight"].split([256, 128, 128])
    torch.testing.assert_close(permute_qk(q.numpy(), 4), ref["blk.0.attn_q.weight"], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(permute_qk(k.numpy(), 2), ref["blk.0.attn_k.weight"], rtol=0, atol=0, equal_nan=True)
    pairs = {
        "model.embed_tokens.weight": "token_embd.weight",
        "lm_head.weight": "output.weight",
        "model.layers.0.self_attn.o_proj.weight": "blk.0.attn_output.weight",
        "model.layers.0.mlp.down_proj.weight": "blk.0.ffn_down.weight",
        "model.layers.0.input_layernorm.weight": "blk.0.attn_norm.weight",
        "model.norm.weight": "output_norm.weight",
    }
    torch.testing.assert_close(v, torch.from_numpy(ref["blk.0.attn_v.weight"]), rtol=0, atol=0, equal_nan=True)
    gate, up = loaded["model.layers.0.mlp.gate_up_proj.weight"].split([256, 256])
    torch.testing.assert_close(gate, torch.from_numpy(ref["blk.0.ffn_gate.weight"]), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(up, torch.from_numpy(ref["blk.0.ffn_up.weight"]), rtol=0, atol=0, equal_nan=True)
    for ours, theirs in pairs.items():
        torch.testing.assert_close(loaded[ours], torch.from_numpy(ref[theirs]), rtol=0, atol=0, equal_nan=True)
    if qtype in QUANTIZABLE_TYPES:
        # Quantized from known weights: close to them, within what the type can hold.
        original = state["model.layers.0.mlp.down_proj.weight"]
        error = (loaded["model.layers.0.mlp.down_proj.weight"] - original).abs().max().item()
        assert error < {"F32": 1e-7, "F16": 1e-3, "BF16": 1e-2, "Q8_0": 0.02}.get(qtype, 0.2)


def test_dtype_is_applied_to_dequantized_weights(tmp_path: pathlib.Path) -> None:
    path = write_gguf(tmp_path / "q8.gguf", QUANT_SPEC, random_state(QUANT_SPEC, QUANT_VOCAB), "Q8_0")
    loaded = load_model(str(path), dtype="bfloat16")
    assert loaded.dtype == torch.bfloat16
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    ref = reference_weights(path)["output.weight"]
    torch.testing.assert_close(loaded.model.lm_head.weight, torch.from_numpy(ref).to(torch.bfloat16), rtol=0, atol=0)


# ------------------------------------------------------------ same model, two formats


def tiny_hf_model(kind: str, path: pathlib.Path) -> tuple[pathlib.Path, Any]:
    """A random transformers model saved at `path`: Llama with GQA and untied head, or Qwen2 (biases, tied)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False, rope_theta=500000.0))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True))
    model.eval().save_pretrained(path)
    return path, model


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_hf_directory_and_gguf_give_the_same_greedy_tokens(tmp_path: pathlib.Path, kind: str) -> None:
    hf_dir, model = tiny_hf_model(kind, tmp_path / "hf")
    state = {k: v for k, v in model.state_dict().items() if not (kind == "qwen2" and k == "lm_head.weight")}
    spec = spec_of(model.config, kind)
    path = write_gguf(tmp_path / f"{kind}.gguf", spec, state, "F32")

    # The q/k permutation undone: the loaded weights are the checkpoint's, bit for bit.
    loaded = load_model(str(path)).model.state_dict()
    expected_qkv = torch.cat([state[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(loaded["model.layers.1.self_attn.qkv_proj.weight"], expected_qkv)
    if kind == "qwen2":
        expected_bias = torch.cat([state[f"model.layers.1.self_attn.{p}_proj.bias"] for p in "qkv"])
        assert torch.equal(loaded["model.layers.1.self_attn.qkv_proj.bias"], expected_bias)

    assert load_model_config(str(path)).tie_word_embeddings == (kind == "qwen2")
    prompts = random_prompts((1, 7, 20, 33))
    from_dir = LLM(str(hf_dir)).generate(prompts, GREEDY)
    from_gguf = LLM(str(path)).generate(prompts, GREEDY)
    expected = hf_greedy(hf_dir, prompts, MAX_TOKENS)
    assert len({tuple(e) for e in expected}) == len(prompts)
    assert [o.token_ids for o in from_gguf] == [o.token_ids for o in from_dir] == expected


def test_llama3_rope_scaling_as_rope_freqs(tmp_path: pathlib.Path, llama_dir: pathlib.Path) -> None:
    # llama.cpp stores Llama 3's rope scaling as a tensor of per-frequency divisors, not as metadata.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32)
    assert model.config.rope_parameters["rope_type"] == "llama3"
    spec = spec_of(model.config, "llama")
    head_dim = spec.hidden_size // spec.num_heads
    plain = 1.0 / (spec.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    factors = (plain / model.model.rotary_emb.inv_freq).numpy().astype(np.float32)
    assert factors.max() > 1.5  # the scaling changes some frequencies
    path = write_gguf(tmp_path / "llama3.gguf", spec, model.state_dict(), extra_tensors={"rope_freqs.weight": factors})

    scaling = load_model_config(str(path)).rope_scaling
    assert scaling == {"rope_type": "freq_factors", "factors": tuple(factors.tolist())}
    prompts = random_prompts((5, 40, 90))
    outputs = LLM(str(path)).generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == hf_greedy(llama_dir, prompts, MAX_TOKENS)


def test_without_unpermuting_the_output_would_differ(tmp_path: pathlib.Path) -> None:
    # Guards the test above: a file written without llama.cpp's permutation loads to other weights.
    hf_dir, model = tiny_hf_model("llama", tmp_path / "hf")
    path = write_gguf(tmp_path / "unpermuted.gguf", spec_of(model.config, "llama"), model.state_dict(), permute=False)
    prompts = random_prompts((7, 20))
    assert [o.token_ids for o in LLM(str(path)).generate(prompts, GREEDY)] != hf_greedy(hf_dir, prompts, MAX_TOKENS)


# ------------------------------------------------------------ SentencePiece (`llama`) tokenizer


@pytest.fixture(scope="module")
def sentencepiece_gguf(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[pathlib.Path, pathlib.Path]]:
    """The same vocabulary twice: with merges, and with scores only (merges recovered from them)."""
    root = tmp_path_factory.mktemp("sp")
    tokens, types, merges = sentencepiece_vocab()
    spec = GGUFSpec(arch="llama", hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2)
    state = random_state(spec, len(tokens))
    # Scores fall with merge order, as a SentencePiece model's do.
    scores = [0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)]
    common = dict(
        model="llama",
        tokens=tokens,
        token_types=types,
        scores=scores,
        bos_token_id=1,
        eos_token_id=2,
        unknown_token_id=0,
    )
    with_merges = write_gguf(root / "merges.gguf", spec, state, tokenizer=GGUFTokenizerSpec(**common, merges=merges))
    scores_only = write_gguf(root / "scores.gguf", spec, state, tokenizer=GGUFTokenizerSpec(**common))
    yield with_merges, scores_only


SENTENCEPIECE_CORPUS = [
    *TOKENIZER_CORPUS,
    "<s>already a bos",
    "the <think>hmm</think> fox",
    "  two leading spaces",
    "byte fallback: Ωß😀",
]


@pytest.mark.parametrize("which", ["merges", "scores"])
def test_sentencepiece_tokenizer_matches_transformers(
    sentencepiece_gguf: tuple[pathlib.Path, pathlib.Path], which: str
) -> None:
    from transformers import AutoTokenizer

    path = sentencepiece_gguf[0 if which == "merges" else 1]
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ours = gguf_tokenizer(open_gguf(path))
    assert ours is not None
    for text in SENTENCEPIECE_CORPUS:
        ids = ref(text)["input_ids"]
        assert ours.encode(text) == ids, text
        assert ids[0] == 1  # llama.cpp's SentencePiece vocabularies add BOS
        assert ours.encode(text, add_special_tokens=False) == ref(text, add_special_tokens=False)["input_ids"], text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), text
    # Byte fallback really happened: Ω is not a piece of the vocabulary.
    assert any(ours.backend.id_to_token(i).startswith("<0x") for i in ours.encode("Ω"))


# ------------------------------------------------------------ byte-level (`gpt2`) tokenizer, other splits


@pytest.mark.parametrize("pre", ["default", "llama-bpe", "qwen2", "smollm"])
def test_byte_level_tokenizer_splits_as_transformers_does(tmp_path: pathlib.Path, pre: str) -> None:
    # `tokenizer.ggml.pre` names the regex that cut text into words before BPE (digits one
    # at a time or three, contractions, case): the vocabulary was learned on that split.
    from transformers import AutoTokenizer

    tokens, types, merges = byte_level_vocab(tmp_path)
    spec = GGUFSpec(arch="llama", hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2)
    tok_spec = GGUFTokenizerSpec(
        model="gpt2",
        tokens=tokens,
        token_types=types,
        merges=merges,
        bos_token_id=1,
        eos_token_id=len(tokens) - 1,
        add_bos_token=True,
        pre=pre,
    )
    path = write_gguf(tmp_path / f"{pre}.gguf", spec, random_state(spec, len(tokens)), tokenizer=tok_spec)
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    ours = gguf_tokenizer(open_gguf(path))
    assert ours is not None and ours.eos_token == "<|im_end|>"
    # Not "<|endoftext|>": absent from this vocabulary, transformers adds it as a new id past
    # the model's embedding (GPT2Tokenizer's default special token), which no model can take.
    corpus = [t for t in TOKENIZER_CORPUS if "<|endoftext|>" not in t]
    for text in [*corpus, "DIGITS 1234567 AND SHOUTING'S", "it'S\r\n\r\n  x"]:
        ids = ref(text)["input_ids"]
        assert ours.encode(text) == ids, text
        assert ids[0] == 1  # add_bos_token: the file asks for BOS
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), text


# ------------------------------------------------------------ errors


def write_small(
    path: pathlib.Path, arch: str = "llama", tokenizer: GGUFTokenizerSpec | None = None, qtype: str = "F32"
) -> pathlib.Path:
    spec = GGUFSpec(arch=arch, hidden_size=256, intermediate_size=256, num_layers=1, num_heads=4, num_kv_heads=2)
    return write_gguf(path, spec, random_state(spec, QUANT_VOCAB), qtype, tokenizer=tokenizer)


def assert_load_error(path: pathlib.Path, *fragments: str) -> None:
    with pytest.raises(ModelLoadError) as info:
        load_model(str(path))
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


def test_unknown_architecture_is_named(tmp_path: pathlib.Path) -> None:
    assert_load_error(write_small(tmp_path / "m.gguf", arch="gpt2"), "unsupported GGUF architecture", "'gpt2'", "llama")


def test_unknown_tokenizer_model_is_named(tmp_path: pathlib.Path) -> None:
    tok = GGUFTokenizerSpec(model="bert", tokens=["[PAD]", "[UNK]"], token_types=[3, 2])
    assert_load_error(write_small(tmp_path / "m.gguf", tokenizer=tok), "unsupported GGUF tokenizer model", "'bert'")


def test_unknown_quantization_type_is_named(tmp_path: pathlib.Path) -> None:
    # Q8_K is a valid ggml type the package cannot dequantize (llama.cpp uses it for activations).
    path = write_small(tmp_path / "q8k.gguf", qtype="Q8_K")
    assert gguf.GGUFReader(path).tensors[-1].tensor_type.name == "Q8_K"
    assert_load_error(path, "unsupported quantization type Q8_K")


def test_unexpected_tensor_is_named(tmp_path: pathlib.Path) -> None:
    spec = GGUFSpec(arch="llama", hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2)
    extra = {"blk.0.attn_mystery.weight": np.ones(64, dtype=np.float32)}
    path = write_gguf(tmp_path / "m.gguf", spec, random_state(spec, 64), extra_tensors=extra)
    assert_load_error(path, "unexpected tensor blk.0.attn_mystery.weight")


def test_a_file_that_is_not_gguf(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"not a gguf file")
    assert_load_error(path, "not a GGUF file")
