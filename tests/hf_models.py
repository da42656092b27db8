"""Random, tiny Hugging Face checkpoints for tests, and transformers' greedy output on them.

Shared by the in-process tests (through `conftest.py`) and the multi-process server tests,
which point a server at a directory `save_random_model` wrote.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

import torch

MODEL_KINDS = ("llama", "llama_tied", "qwen2", "mistral", "llama_tokenizer")

VOCAB_SIZE = 512
# initializer_range=0.2 (not the default 0.02): random models then give varied tokens,
# so a comparison with transformers tells an off-by-one from a match.
_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    max_position_embeddings=256,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
)
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

TOKENIZER_SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a key value cache holds the keys and values of every past token",
    "prefill workers stream blocks to decode workers over grpc",
    "héllo wörld, ça va? naïve café — 東京 と 大阪 🙂🚀",
    "Numbers 0123456789 and punctuation !?.,;:()[]{}",
]

# Text a tokenizer gets wrong in many small ways: unicode, emoji, CJK, whitespace runs,
# tabs and newlines, digits, special tokens written into the text.
TOKENIZER_CORPUS = [
    *TOKENIZER_SENTENCES,
    "",
    " ",
    "Hello, world!",
    "  leading spaces and trailing   ",
    "tabs\tand\nnew\n\nlines\r\n",
    "digits 1234567890 and 3.14159 and 1,000,000",
    "naïve café, Ωmega ≈ √2, ß and Æ",
    "东京和大阪 and 東京 と 大阪 and 서울",
    "emoji 🙂🚀👩‍👩‍👧 and flags 🇫🇷",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
    "code:\n    def f(x):\n        return x ** 2  # square\n",
    "It's, we're, they'll, I'd, you've",
    "mixed\u00a0nbsp\u200bzero-width",
]


def _build(kind: str) -> torch.nn.Module:
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    if kind in ("llama", "llama_tokenizer"):
        cfg = LlamaConfig(
            **_COMMON,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_scaling=dict(_LLAMA3_ROPE),
        )
        return LlamaForCausalLM(cfg)
    if kind == "llama_tied":
        cfg = LlamaConfig(**_COMMON, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)
        return LlamaForCausalLM(cfg)
    if kind == "qwen2":
        cfg = Qwen2Config(**_COMMON, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
        return Qwen2ForCausalLM(cfg)
    if kind == "mistral":
        cfg = MistralConfig(**_COMMON, num_attention_heads=4, num_key_value_heads=2, sliding_window=None)
        return MistralForCausalLM(cfg)
    raise ValueError(f"kind: unknown {kind!r}; known: {', '.join(MODEL_KINDS)}")


def save_random_model(
    kind: str,
    path: str | pathlib.Path,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
) -> pathlib.Path:
    """Write a random `kind` checkpoint (config.json + safetensors) to `path`; returns it.

    `llama_tokenizer` also writes a byte-level BPE `tokenizer.json` (vocabulary <= the model's).
    """
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = _build(kind).eval().to(dtype)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    if kind == "llama_tokenizer":
        save_tokenizer(path / "tokenizer.json", vocab_size=VOCAB_SIZE)
    return path


def save_tokenizer(file: str | pathlib.Path, vocab_size: int = 400) -> pathlib.Path:
    """Train a small byte-level BPE on `TOKENIZER_SENTENCES` and save it as tokenizer.json.

    Ids 0, 1, 2 are <unk>, <s> (BOS, prepended by encode) and </s>, as in the models' configs.
    """
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TOKENIZER_SENTENCES, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    assert tok.get_vocab_size() <= vocab_size
    tok.save(str(file))
    return pathlib.Path(file)


def hf_greedy(path: str | pathlib.Path, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (one at a time, float32), EOS ignored."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    outputs: list[list[int]] = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([list(prompt)]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def random_prompts(lengths: Sequence[int], seed: int = 1, vocab_size: int = VOCAB_SIZE) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]
