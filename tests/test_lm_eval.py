"""lm-evaluation-harness against a launched 1P1D cluster on SmolLM2: its `local-completions`
model (loglikelihoods through `/v1/completions` with `echo` and `logprobs`) scores a small
multiple-choice task written here (no downloads) as lm-eval's own `hf` model does on the
same GGUF weights: the same accuracy, every choice's loglikelihood within float tolerance,
the same is_greedy flags."""

from __future__ import annotations

import asyncio
import json
import math
import pathlib
from typing import Any

import pytest
import yaml
from conftest import local_cluster

from kvservice.client.bench.kv_dtype import LM_EVAL_QUESTIONS

pytestmark = pytest.mark.slow

TASK = "kvservice_easy_choices"
# (question, choices, index of the answer): easy enough that a 135M model gets most right,
# some answers several tokens long (`kvservice bench kv-dtype` scores them per KV cache dtype).
QUESTIONS = LM_EVAL_QUESTIONS
NUM_CHOICES = 4
# Our kernels run on the Q4_1 nibbles, transformers on the weights dequantized to float32:
# the same math in another summation order (measured: at most 4e-5 apart).
LOGLIKELIHOOD_ATOL = 1e-4
WORKER_ARGS = ("--num-threads", "1", "--dtype", "float32", "--max-model-len", "1024", "--kv-cache-mib", "64")
PROXY_ARGS = ("--http-port", "0", "--model", "smollm2", "--health-interval", "0.2")

Choices = list[tuple[float, bool]]  # per choice: (loglikelihood, is_greedy)


def write_task(directory: pathlib.Path) -> pathlib.Path:
    """`TASK` as lm-eval reads it: a task YAML and its JSONL data in `directory`, loaded
    with the `json` dataset builder from the local file."""
    directory.mkdir(parents=True, exist_ok=True)
    data = directory / f"{TASK}.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    config = {
        "task": TASK,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "{{question}}",
        "doc_to_choice": "choices",
        "doc_to_target": "answer",
        "metric_list": [
            {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
            {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
        ],
    }
    (directory / f"{TASK}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return directory


def evaluate(model: str, model_args: dict[str, Any], task_dir: pathlib.Path) -> dict[str, Any]:
    """`lm_eval.simple_evaluate` of `TASK` alone (none of lm-eval's own tasks indexed), samples kept."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    task_manager = TaskManager(include_path=str(task_dir), include_defaults=False)
    results = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[TASK],
        task_manager=task_manager,
        batch_size=1,
        log_samples=True,
        bootstrap_iters=0,
    )
    assert results is not None
    return results


def per_choice(results: dict[str, Any]) -> list[Choices]:
    """Per question (in the file's order), each choice's (loglikelihood, is_greedy)."""
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    return [[(float(ll), bool(greedy)) for ll, greedy in s["filtered_resps"]] for s in samples]


def per_question_acc(results: dict[str, Any]) -> list[float]:
    return [s["acc"] for s in sorted(results["samples"][TASK], key=lambda s: s["doc_id"])]


def print_table(served: list[Choices], reference: list[Choices]) -> None:
    """The comparison as a table (shown with `pytest -s`): per choice, both loglikelihoods."""
    print("\n| question | choice | kvservice 1P1D | lm-eval hf | difference |\n| --- | --- | --- | --- | --- |")
    for (question, choices, _), got, expected in zip(QUESTIONS, served, reference):
        for choice, (ll, _), (ref, _) in zip(choices, got, expected):
            print(f"| {question} | {choice} | {ll:.5f} | {ref:.5f} | {ll - ref:+.1e} |")
    worst = max(abs(ll - ref) for got, expected in zip(served, reference) for (ll, _), (ref, _) in zip(got, expected))
    print(f"largest difference: {worst:.2e}")


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_task(tmp_path_factory.mktemp("lm_eval_task"))


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_hf_tokenizer: Any) -> pathlib.Path:
    """The GGUF's tokenizer saved as a directory: `local-completions` loads its tokenizer by
    path (no `gguf_file` there) to count the context's tokens."""
    directory = tmp_path_factory.mktemp("smollm2_tokenizer")
    smollm2_hf_tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def hf_reference(smollm2_file: pathlib.Path, task_dir: pathlib.Path) -> dict[str, Any]:
    """lm-eval's `hf` model on the GGUF (transformers dequantizes it to float32), on the CPU."""
    model_args = {
        "pretrained": str(smollm2_file.parent),
        "gguf_file": smollm2_file.name,
        "dtype": "float32",
        "device": "cpu",
    }
    return evaluate("hf", model_args, task_dir)


def test_saved_tokenizer_encodes_like_the_gguf_one(tokenizer_dir: pathlib.Path, smollm2_hf_tokenizer: Any) -> None:
    """Both models of the comparison split every context and choice into the same tokens."""
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    texts = [q for q, _, _ in QUESTIONS] + [f"{q} {c}" for q, choices, _ in QUESTIONS for c in choices]
    assert [saved(t, add_special_tokens=False).input_ids for t in texts] == [
        smollm2_hf_tokenizer(t, add_special_tokens=False).input_ids for t in texts
    ]
    # lm-eval's two models encode differently (hf with the tokenizer's default, the API without
    # special tokens): the same only because this tokenizer adds no BOS.
    assert saved(texts[0]).input_ids == saved(texts[0], add_special_tokens=False).input_ids


def test_hf_reference_scores_the_easy_questions(hf_reference: dict[str, Any]) -> None:
    metrics = hf_reference["results"][TASK]
    assert metrics["acc,none"] > 2 / NUM_CHOICES, metrics  # twice chance: the model reads the questions
    choices = per_choice(hf_reference)
    assert [len(c) for c in choices] == [NUM_CHOICES] * len(QUESTIONS)
    assert all(math.isfinite(ll) and ll < 0 for c in choices for ll, _ in c)
    assert per_question_acc(hf_reference)[0] == 1.0
    assert choices[0][0][1] and not choices[0][1][1]  # " Paris" is the greedy continuation, " Berlin" is not


async def test_local_completions_against_1p1d_cluster_matches_hf(
    hf_reference: dict[str, Any], task_dir: pathlib.Path, tokenizer_dir: pathlib.Path
) -> None:
    async with local_cluster("smollm2", worker_args=WORKER_ARGS, proxy_args=PROXY_ARGS, startup_timeout=300) as cluster:
        model_args = {
            "model": "smollm2",
            "base_url": f"http://{cluster.child('proxy').http_address}/v1/completions",
            # Local tokenizer, never `auto` (it probes the server, then falls back to the hub).
            "tokenizer": str(tokenizer_dir),
            "tokenizer_backend": "huggingface",
            "tokenized_requests": True,  # token ids on the wire: the server scores lm-eval's own split
            "num_concurrent": 1,
            "max_retries": 1,  # a refused request fails the test now, not after back-offs
            "max_length": 1024,  # the workers' --max-model-len
        }
        served = await asyncio.to_thread(evaluate, "local-completions", model_args, task_dir)
    assert served["results"][TASK]["acc,none"] == hf_reference["results"][TASK]["acc,none"]
    assert served["results"][TASK]["acc_norm,none"] == hf_reference["results"][TASK]["acc_norm,none"]
    assert per_question_acc(served) == per_question_acc(hf_reference)
    print_table(per_choice(served), per_choice(hf_reference))
    for question, got, expected in zip(QUESTIONS, per_choice(served), per_choice(hf_reference)):
        assert [greedy for _, greedy in got] == [greedy for _, greedy in expected], question
        assert [ll for ll, _ in got] == pytest.approx([ll for ll, _ in expected], abs=LOGLIKELIHOOD_ATOL), question
