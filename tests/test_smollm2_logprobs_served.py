"""SmolLM2's logprobs as a client gets them (`/v1/completions` with `echo` and `logprobs`),
disaggregated and colocated, prefix caching on and off, against transformers' log-softmax
of its logits on the same GGUF weights (float32): prompt and generated positions within 1e-4."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from typing import Any

import pytest
import torch
from conftest import local_cluster

pytestmark = [pytest.mark.slow, pytest.mark.asyncio, pytest.mark.timeout(300)]

MODEL = "smollm2"
PROMPT = "The three primary colors are red, blue and"
MAX_TOKENS = 8
NUM_TOP = 5
ATOL = 1e-4
WORKER_ARGS = ("--num-threads", "1", "--dtype", "float32", "--max-model-len", "512", "--kv-cache-mib", "32")


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)


@pytest.mark.parametrize("deployment", ["1p1d", "colocated"])
@pytest.mark.parametrize("enable_prefix_caching", [True, False])
async def test_served_logprobs_match_transformers(
    deployment: str, enable_prefix_caching: bool, smollm2_hf_model: Any, smollm2_hf_tokenizer: Any
) -> None:
    worker_args = WORKER_ARGS if enable_prefix_caching else (*WORKER_ARGS, "--no-enable-prefix-caching")
    if deployment == "colocated":
        kwargs: dict[str, Any] = dict(worker_args=(*worker_args, "--http-port", "0"), colocated=True)
    else:
        kwargs = dict(
            worker_args=worker_args, proxy_args=("--http-port", "0", "--model", MODEL, "--health-interval", "0.2")
        )
    prompt_ids = smollm2_hf_tokenizer(PROMPT)["input_ids"]
    body = {
        "model": MODEL,
        "prompt": prompt_ids,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "logprobs": NUM_TOP,
        "echo": True,
        "ignore_eos": True,
    }
    async with local_cluster(MODEL, startup_timeout=240, **kwargs) as cluster:
        front = cluster.child("both" if cluster.colocated else "proxy").http_address
        # Twice: with caching on, the second request's prompt is cached and still computed for its logprobs.
        answers = [await asyncio.to_thread(post, f"http://{front}/v1/completions", body) for _ in range(2)]
    for answer in answers:
        choice = answer["choices"][0]
        token_ids = prompt_ids + choice["token_ids"]
        with torch.no_grad():
            reference = smollm2_hf_model(torch.tensor([token_ids])).logits[0].float().log_softmax(-1)
        values = choice["logprobs"]["token_logprobs"]
        assert len(values) == len(token_ids) and values[0] is None
        expected = [float(reference[p - 1, token_ids[p]]) for p in range(1, len(token_ids))]
        assert values[1:] == pytest.approx(expected, abs=ATOL)
        for p, top in enumerate(choice["logprobs"]["top_logprobs"][1:], start=1):
            best = reference[p - 1].topk(NUM_TOP).values.tolist()
            assert max(top.values()) == pytest.approx(best[0], abs=ATOL)
        # Greedy: every generated token is the reference's most likely one.
        assert choice["token_ids"] == [int(reference[len(prompt_ids) - 1 + i].argmax()) for i in range(MAX_TOKENS)]
    assert answers[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert answers[1]["choices"][0]["token_ids"] == answers[0]["choices"][0]["token_ids"]
