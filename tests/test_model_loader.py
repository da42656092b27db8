from __future__ import annotations

import json
import pathlib
import shutil
from collections.abc import Callable

import pytest
import torch
from hf_models import random_prompts, save_random_model
from safetensors.torch import load_file, save_file

from kvservice import LLM, SamplingParams
from kvservice.loading.model_files import TINY_CONFIG, load_model_config
from kvservice.loading.model_loader import ModelLoadError, load_model

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def assert_load_error(model: str | pathlib.Path, *fragments: str) -> ModelLoadError:
    with pytest.raises(ModelLoadError) as info:
        load_model(str(model))
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message
    return info.value


def copy_config_only(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    return dst


def test_missing_directory(tmp_path: pathlib.Path) -> None:
    missing = tmp_path / "no-such-model"
    assert_load_error(missing, str(missing), "not a model directory")


def test_missing_config_json(tmp_path: pathlib.Path) -> None:
    assert_load_error(tmp_path, "missing config.json")


def test_malformed_config_json(tmp_path: pathlib.Path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], ')
    assert_load_error(tmp_path, "bad config.json")


def test_unsupported_architecture(tmp_path: pathlib.Path) -> None:
    from transformers import GPT2Config

    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, bos_token_id=0, eos_token_id=0)
    config.architectures = ["GPT2LMHeadModel"]
    config.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "gpt2"
    assert_load_error(tmp_path, "unsupported architecture", "GPT2LMHeadModel", "LlamaForCausalLM")


def test_config_missing_a_required_field(tmp_path: pathlib.Path, llama_dir: pathlib.Path) -> None:
    config = json.loads((llama_dir / "config.json").read_text())
    del config["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert_load_error(tmp_path, "hidden_size")


def test_missing_safetensors(tmp_path: pathlib.Path, llama_dir: pathlib.Path) -> None:
    path = copy_config_only(llama_dir, tmp_path / "m")
    assert_load_error(path, "no *.safetensors")


def test_missing_weight_tensor(tmp_path: pathlib.Path, llama_dir: pathlib.Path) -> None:
    path = copy_config_only(llama_dir, tmp_path / "m")
    state = load_file(str(llama_dir / "model.safetensors"))
    del state["model.layers.1.mlp.down_proj.weight"]
    save_file(state, str(path / "model.safetensors"))
    assert_load_error(path, "missing weight", "model.layers.1.mlp.down_proj.weight")


def test_sharded_checkpoint_loads_like_the_unsharded_one(tmp_path: pathlib.Path, llama_dir: pathlib.Path) -> None:
    # Same kind, same seed as llama_dir: the same weights, split over several files.
    sharded = save_random_model("llama", tmp_path / "sharded", max_shard_size="100KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (sharded / "model.safetensors").exists()

    whole = load_model(str(llama_dir)).model.state_dict()
    split = load_model(str(sharded)).model.state_dict()
    assert whole.keys() == split.keys()
    assert all(torch.equal(whole[k], split[k]) for k in whole)

    prompts = random_prompts([3, 17, 40])
    expected = LLM(str(llama_dir), num_blocks=16).generate(prompts, GREEDY)
    got = LLM(str(sharded), num_blocks=16).generate(prompts, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]


def test_missing_shard(tmp_path: pathlib.Path) -> None:
    sharded = save_random_model("llama", tmp_path / "sharded", max_shard_size="100KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[-1]
    (sharded / victim).unlink()
    assert_load_error(sharded, "missing weight shard", victim)


def test_tied_checkpoint_shares_the_embedding(llama_tied_dir: pathlib.Path) -> None:
    model = load_model(str(llama_tied_dir)).model
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_unknown_dtype_is_refused() -> None:
    with pytest.raises(ModelLoadError, match="dtype"):
        load_model("tiny", dtype="int8")


def test_tiny_model_is_deterministic() -> None:
    assert load_model_config("tiny") == TINY_CONFIG
    first = load_model("tiny").model.state_dict()
    second = load_model("tiny").model.state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)
    prompts = [[256, *b"hello"], [256, *b"determinism"]]
    a = LLM("tiny", num_blocks=16, max_model_len=64).generate(prompts, GREEDY)
    b = LLM("tiny", num_blocks=16, max_model_len=64).generate(prompts, GREEDY)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert len(set(a[0].token_ids + a[1].token_ids)) > 2


def test_generation_config_eos_ids_stop_generation(tmp_path: pathlib.Path, llama_dir: pathlib.Path) -> None:
    # Instruct checkpoints list their end-of-turn token in generation_config.json, not config.json.
    model_dir = tmp_path / "model"
    shutil.copytree(llama_dir, model_dir)
    prompt = random_prompts((9,))[0]
    [free] = LLM(str(model_dir)).generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    stop_at = next(i for i, t in enumerate(free.token_ids) if i >= 3 and t not in free.token_ids[:i] and t != 2)
    end_of_turn = free.token_ids[stop_at]
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, end_of_turn]}))

    assert load_model_config(str(model_dir)).eos_token_ids == (2, end_of_turn)
    [out] = LLM(str(model_dir)).generate([prompt], SamplingParams(temperature=0, max_tokens=12))
    assert out.token_ids == free.token_ids[: stop_at + 1]
    assert out.finish_reason == "stop"


def test_bad_generation_config_is_named(tmp_path: pathlib.Path, llama_dir: pathlib.Path) -> None:
    model_dir = tmp_path / "model"
    shutil.copytree(llama_dir, model_dir)
    (model_dir / "generation_config.json").write_text("{")
    assert_load_error(model_dir, "bad generation_config.json")


def test_bad_tokenizer_config_is_named(tmp_path: pathlib.Path, hf_model_dir: Callable[[str], pathlib.Path]) -> None:
    model_dir = tmp_path / "model"
    shutil.copytree(hf_model_dir("llama_tokenizer"), model_dir)
    (model_dir / "tokenizer_config.json").write_text('{"chat_template": ')
    assert_load_error(model_dir, "bad tokenizer_config.json")
