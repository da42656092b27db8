"""The engine's greedy output equals Hugging Face transformers', token for token.

The cache and the step budget are small on purpose, so the batch goes through chunked
prefill and preemption (recompute) on the way: neither may change a single token.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable

import pytest
import torch
from hf_models import hf_greedy, random_prompts, save_random_model
from tokenizers import Tokenizer as HFTokenizerLib

from kvservice import LLM, SamplingParams
from kvservice.core.outputs import SchedulerOutput
from kvservice.core.request import Request
from kvservice.engine.scheduler import Scheduler

PROMPT_LENGTHS = (1, 5, 15, 16, 17, 31, 33, 50, 64, 70)
MAX_TOKENS = 20
# 70 + 20 tokens need 6 blocks of 16; 14 blocks cannot hold four such requests at once,
# and 40 tokens a step cannot hold a 64-token prompt: preemption and chunking both happen.
SMALL_ENGINE = dict(num_blocks=14, max_num_batched_tokens=40, max_num_seqs=4)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


class ScheduleLog:
    """Records what each `schedule()` call decided (a spy on the engine's scheduler)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.requests: dict[str, Request] = {}
        self.preempted_req_ids: set[str] = set()
        self.partial_prefills: list[tuple[str, int, int]] = []  # (request_id, start, end) short of the prompt
        self.num_batched_tokens: list[int] = []
        original = scheduler.schedule

        def schedule() -> SchedulerOutput:
            out = original()
            self.preempted_req_ids |= out.preempted_req_ids
            self.num_batched_tokens.append(sum(s.num_new_tokens for s in out.scheduled))
            for s in out.scheduled:
                request = s.request
                self.requests[request.request_id] = request
                end = request.num_computed_tokens + s.num_new_tokens
                if end < request.num_prompt_tokens:
                    self.partial_prefills.append((request.request_id, request.num_computed_tokens, end))
            return out

        scheduler.schedule = schedule  # type: ignore[method-assign]


@pytest.mark.parametrize("kind", ["llama", "llama_tied", "qwen2", "mistral"])
def test_greedy_matches_transformers_through_chunking_and_preemption(
    kind: str, hf_model_dir: Callable[[str], pathlib.Path]
) -> None:
    path = hf_model_dir(kind)
    prompts = random_prompts(PROMPT_LENGTHS)
    expected = hf_greedy(path, prompts, MAX_TOKENS)
    # A degenerate model (one token forever) would match almost anything.
    assert len({tuple(r) for r in expected}) == len(prompts)
    assert all(len(set(r)) > 3 for r in expected)

    llm = LLM(str(path), **SMALL_ENGINE)
    log = ScheduleLog(llm.engine.core.scheduler)
    outputs = llm.generate(prompts, GREEDY)

    assert log.partial_prefills, "no prompt was split across steps"
    assert log.preempted_req_ids, "no request was preempted"
    assert all(log.requests[r].num_preemptions > 0 for r in log.preempted_req_ids)
    assert max(log.num_batched_tokens) <= SMALL_ENGINE["max_num_batched_tokens"]
    for prompt, out, ref in zip(prompts, outputs, expected):
        assert out.prompt_token_ids == prompt
        assert out.finish_reason == "length"
        assert out.token_ids == ref, f"prompt of {len(prompt)} tokens"
    assert llm.engine.num_free_blocks == llm.engine.num_blocks
    assert llm.engine.core.scheduler.num_unfinished == 0
    assert not llm.engine.core.scheduler.requests


def test_block_size_does_not_change_output(llama_dir: pathlib.Path) -> None:
    prompts = random_prompts(PROMPT_LENGTHS, seed=2)
    expected = hf_greedy(llama_dir, prompts, 8)
    llm = LLM(str(llama_dir), block_size=4, num_blocks=64, max_num_batched_tokens=24, max_num_seqs=3)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in outputs] == expected
    assert llm.engine.num_free_blocks == llm.engine.num_blocks


def test_bfloat16_generates_every_requested_token(llama_dir: pathlib.Path) -> None:
    llm = LLM(str(llama_dir), dtype="bfloat16", **SMALL_ENGINE)
    assert llm.engine.core.loaded.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in llm.engine.core.loaded.model.parameters())
    assert all(c.dtype == torch.bfloat16 for c in llm.engine.core.kv_caches)
    prompts = random_prompts(PROMPT_LENGTHS)
    outputs = llm.generate(prompts, GREEDY)
    assert [len(o.token_ids) for o in outputs] == [MAX_TOKENS] * len(prompts)
    assert all(0 <= t < 512 for o in outputs for t in o.token_ids)
    assert llm.engine.num_free_blocks == llm.engine.num_blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_auto_dtype_is_the_checkpoints(dtype: torch.dtype, tmp_path: pathlib.Path) -> None:
    path = save_random_model("llama_tied", tmp_path / "m", dtype=dtype)
    llm = LLM(str(path), num_blocks=8)
    assert llm.engine.core.loaded.dtype == dtype
    assert llm.engine.core.loaded.model.model.embed_tokens.weight.dtype == dtype
    [out] = llm.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out.token_ids) == 4


def test_text_prompts_decode_with_the_models_tokenizer(tokenizer_model_dir: pathlib.Path) -> None:
    tok = HFTokenizerLib.from_file(str(tokenizer_model_dir / "tokenizer.json"))
    texts = ["the quick brown fox", "héllo wörld, 東京 🙂", "a"]
    llm = LLM(str(tokenizer_model_dir), num_blocks=32)
    assert llm.tokenizer is not None
    outputs = llm.generate(texts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))

    encoded = [tok.encode(t).ids for t in texts]
    assert all(ids[0] == 1 for ids in encoded)  # BOS from the tokenizer's template
    assert [o.prompt_token_ids for o in outputs] == encoded
    assert [o.token_ids for o in outputs] == hf_greedy(tokenizer_model_dir, encoded, 24)
    for out in outputs:
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
    assert any(out.text for out in outputs)


def test_streamed_text_deltas_add_up_to_the_text(tokenizer_model_dir: pathlib.Path) -> None:
    tok = HFTokenizerLib.from_file(str(tokenizer_model_dir / "tokenizer.json"))
    llm = LLM(str(tokenizer_model_dir), num_blocks=32)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    request_ids = [engine.add_request(t, params) for t in ["naïve café 🚀", "over grpc"]]
    deltas: dict[str, list[str]] = {r: [] for r in request_ids}
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas[out.request_id].append(out.new_text)
            assert "\ufffd" not in out.new_text or "\ufffd" in tok.decode(out.token_ids)
            if out.finished:
                final[out.request_id] = out
    for request_id in request_ids:
        out = final[request_id]
        assert "".join(deltas[request_id]) == out.text == tok.decode(out.token_ids, skip_special_tokens=True)
