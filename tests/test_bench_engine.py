"""`kvservice bench engine` compares like with like: transformers gets the engine's own weights."""

from __future__ import annotations

import pytest
import torch

from kvservice import LLM, SamplingParams
from kvservice.client.bench.engine import reference_model, run


@pytest.mark.parametrize("model", ["tiny", "random-small"])
def test_reference_model_generates_what_the_engine_generates(model: str, tmp_path) -> None:
    if model == "random-small":
        from kvservice.client.bench.engine import BENCH_MODEL, save_bench_model

        save_bench_model(tmp_path, {**BENCH_MODEL, "num_hidden_layers": 2, "tie_word_embeddings": True})
        model = str(tmp_path)
    llm = LLM(model, num_blocks=32)
    hf = reference_model(llm.engine.core.loaded.model, torch.float32)
    prompts = [[5, 17, 42, 9], [3, 1, 4, 1, 5, 9, 2, 6]]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outputs):
        with torch.inference_mode():
            ref = hf.generate(
                torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None
            )
        assert out.token_ids == ref[0, len(prompt) :].tolist()
    assert len({tuple(o.token_ids) for o in outputs}) == len(prompts)


def test_bench_engine_reports_both_sides() -> None:
    [row] = run([2], prompt_len=4, max_tokens=3, repeats=1, model="tiny")
    assert row.batch_size == 2
    for side in (row.kvservice, row.transformers):
        assert side.prefill_tokens_per_s > 0 and side.decode_tokens_per_s > 0


def test_random_smollm2_has_the_shape_the_loader_reads_from_the_gguf() -> None:
    """The bench keeps SmolLM2's shape for machines without the GGUF; it must stay the real one."""
    from kvservice.client.bench.engine import SMOLLM2_SHAPE, hf_config_arguments
    from kvservice.loading.model_files import SMOLLM2_MODEL, load_model_config

    real = hf_config_arguments(load_model_config(SMOLLM2_MODEL))
    assert real.keys() == SMOLLM2_SHAPE.keys()
    assert {k: v for k, v in real.items() if k != "rms_norm_eps"} == {
        k: v for k, v in SMOLLM2_SHAPE.items() if k != "rms_norm_eps"
    }
    assert real["rms_norm_eps"] == pytest.approx(
        SMOLLM2_SHAPE["rms_norm_eps"], rel=1e-6
    )  # stored as float32 in the GGUF
