"""Matmul weights prepared for the CPU (packed LM head, bfloat16 widened) change no result."""

from __future__ import annotations

import pytest
import torch

from kvservice import model as model_module
from kvservice.attention import AttentionMetadata, PrefillSpan
from kvservice.model import CausalLM, Linear
from kvservice.model_loader import TINY_CONFIG, load_model


def _logits(net: CausalLM, num_tokens: int) -> torch.Tensor:
    """Float32 logits [T, V] of one prefill of `num_tokens` random tokens."""
    cfg = net.config
    ids = torch.randint(0, cfg.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(0))
    dtype = net.model.embed_tokens.weight.dtype
    kv = [torch.zeros(2, 4, 16, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
    meta = AttentionMetadata(torch.arange(num_tokens), 0, None, None, [PrefillSpan(0, num_tokens)])
    return net.compute_logits(net(ids, torch.arange(num_tokens), kv, meta))


@pytest.mark.parametrize("num_tokens", [1, 16, 37])
def test_packed_lm_head_gives_the_same_logits(num_tokens: int) -> None:
    net = load_model("tiny").model
    expected = _logits(net, num_tokens)
    net.prepare_for_cpu(batch_hint=16)
    assert isinstance(net.lm_head, Linear) and net.lm_head.is_packed
    got = _logits(net, num_tokens)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_bfloat16_widened_matches_the_bfloat16_matmuls(monkeypatch: pytest.MonkeyPatch) -> None:
    net = load_model("tiny", dtype="bfloat16").model
    expected = _logits(net, 24)  # torch's own bfloat16 matmuls, float32 accumulation
    monkeypatch.setattr(model_module, "has_native_bf16_matmul", lambda: False)
    net.prepare_for_cpu(batch_hint=16)
    widened = [m for m in net.modules() if isinstance(m, Linear) and m.compute_weight is not None]
    assert len(widened) == 4 * TINY_CONFIG.num_hidden_layers + 1
    assert all(p.dtype == torch.bfloat16 for p in net.parameters())  # the parameters stay as loaded
    got = _logits(net, 24)
    # Same products, same float32 accumulation: only the summation order differs, and
    # bfloat16 rounding of each layer's output may flip a last bit.
    torch.testing.assert_close(got, expected, atol=0.05, rtol=0.02)
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9
