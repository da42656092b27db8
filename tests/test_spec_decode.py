"""Speculative decoding: greedy equals plain greedy, sampling keeps the target's law,
the draft pass overlaps the KV save (finalize after it), and no block leaks; with a draft
model and with prompt lookup (ngram)."""

from __future__ import annotations

import json
import pathlib
import re

import pytest
import torch
from conftest import local_cluster
from hf_models import random_prompts, save_random_model
from safetensors.torch import load_file, save_file
from test_connector_lifecycle import RecordingConnector

from kvservice import LLM, SamplingParams
from kvservice.config import EngineConfig
from kvservice.engine.engine import LLMEngine
from kvservice.engine.engine_builder import build_engine
from kvservice.worker import input_batch
from kvservice.worker.input_batch import BatchItem, decode_group
from kvservice.worker.ngram_proposer import NgramProposer
from kvservice.worker.rejection_sampler import verify_draft_tokens

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
ENGINE = dict(num_blocks=48, max_num_batched_tokens=48, max_num_seqs=4, dtype="float32")


def first_layer_draft(target: pathlib.Path, path: pathlib.Path) -> pathlib.Path:
    """A draft made of the target's first layer (plus its embeddings and head): agrees often, not always."""
    path.mkdir(parents=True, exist_ok=True)
    config = json.loads((target / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))
    tensors = {}
    for shard in target.glob("*.safetensors"):
        tensors.update(load_file(str(shard)))
    kept = {k: v for k, v in tensors.items() if not k.startswith("model.layers.") or k.startswith("model.layers.0.")}
    save_file(kept, str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, pathlib.Path]:
    root = tmp_path_factory.mktemp("spec")
    target = save_random_model("llama", root / "target")
    return target, first_layer_draft(target, root / "draft")


def test_greedy_speculation_equals_plain_greedy_with_rejections(models: tuple[pathlib.Path, pathlib.Path]) -> None:
    target, draft = models
    prompts = random_prompts([1, 5, 17, 33, 40, 3, 16], seed=3)
    plain = LLM(str(target), **ENGINE).generate(prompts, GREEDY)
    llm = LLM(str(target), draft_model=str(draft), num_speculative_tokens=3, **ENGINE)
    spec = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    scheduler = llm.engine.core.scheduler
    # Both verdicts happened: some drafts accepted, some rejected.
    assert 0 < scheduler.num_accepted_tokens < scheduler.num_draft_tokens
    assert llm.engine.num_free_blocks == llm.engine.num_blocks


def test_a_draft_identical_to_the_target_is_always_accepted(models: tuple[pathlib.Path, pathlib.Path]) -> None:
    target, _ = models
    llm = LLM(str(target), draft_model=str(target), num_speculative_tokens=4, **ENGINE)
    out = llm.generate(random_prompts([9, 20], seed=4), GREEDY)
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in out)
    scheduler = llm.engine.core.scheduler
    assert scheduler.num_draft_tokens > 0 and scheduler.num_accepted_tokens == scheduler.num_draft_tokens


def test_seeded_sampling_with_speculation_is_reproducible(models: tuple[pathlib.Path, pathlib.Path]) -> None:
    target, draft = models
    params = SamplingParams(temperature=0.8, top_k=50, max_tokens=20, seed=7, ignore_eos=True)
    runs = [
        LLM(str(target), draft_model=str(draft), num_speculative_tokens=2, **ENGINE).generate(
            random_prompts([12], seed=5), params
        )
        for _ in range(2)
    ]
    assert runs[0][0].token_ids == runs[1][0].token_ids
    assert len(runs[0][0].token_ids) == 20


def test_draft_with_another_vocabulary_is_refused(models: tuple[pathlib.Path, pathlib.Path]) -> None:
    target, _ = models
    with pytest.raises(ValueError, match="draft_model"):
        LLM(str(target), draft_model="tiny", num_speculative_tokens=2, **ENGINE)


def test_rejection_sampling_keeps_the_target_distribution() -> None:
    """Chi-square on a 6-token vocabulary: with drafts drawn from q, the emitted tokens
    follow p (first and second position), whatever q is."""
    gen = torch.Generator().manual_seed(0)
    vocab, trials = 6, 12000
    target_logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 0.3], [0.1, 0.2, 1.5, -0.5, 0.9, 0.0], [0.0] * 6])
    q = torch.tensor([[0.05, 0.4, 0.05, 0.3, 0.1, 0.1], [0.3, 0.1, 0.1, 0.2, 0.2, 0.1]])
    params = SamplingParams(temperature=1.0)
    p = target_logits.softmax(-1)
    first = torch.zeros(vocab)
    second_given_first0 = torch.zeros(vocab)
    for _ in range(trials):
        drafts = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(2)]
        out = verify_draft_tokens(target_logits, drafts, q, params, gen)
        first[out[0]] += 1
        if out[0] == 0 and len(out) > 1:
            second_given_first0[out[1]] += 1
    critical = 20.52  # chi-square, 5 degrees of freedom, p = 0.001
    expected = p[0] * trials
    assert float(((first - expected) ** 2 / expected).sum()) < critical
    n = second_given_first0.sum()
    expected2 = p[1] * n
    assert n > 400 and float(((second_given_first0 - expected2) ** 2 / expected2).sum()) < critical
    # And the test can fail: q's law is far from p's.
    expected_q = q[0] * trials
    assert float(((first - expected_q) ** 2 / expected_q).sum()) > 10 * critical


def test_greedy_verification_accepts_the_matching_prefix() -> None:
    logits = torch.full((4, 5), -10.0)
    for row, token in enumerate([3, 1, 4, 2]):
        logits[row, token] = 10.0
    greedy = SamplingParams(temperature=0.0)
    assert verify_draft_tokens(logits, [3, 1, 4], None, greedy, None) == [3, 1, 4, 2]  # all + bonus
    assert verify_draft_tokens(logits, [3, 0, 4], None, greedy, None) == [3, 1]  # first mismatch replaced
    assert verify_draft_tokens(logits, [0, 1, 4], None, greedy, None) == [3]


def _recording_draft_passes(engine: LLMEngine, connector: RecordingConnector) -> LLMEngine:
    """`engine`, its draft passes recorded among `connector`'s calls as ("draft_pass", ())."""
    drafter = engine.core.runner.drafter
    assert drafter is not None
    original = drafter.propose

    def recorded_propose(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        connector.calls.append(("draft_pass", ()))
        return original(*args, **kwargs)

    drafter.propose = recorded_propose  # type: ignore[method-assign]
    return engine


def test_wait_for_save_runs_after_the_draft_pass_and_outputs_reach_the_scheduler(
    models: tuple[pathlib.Path, pathlib.Path],
) -> None:
    target, draft = models
    connector = RecordingConnector(delay_free=True)
    config = EngineConfig(draft_model=str(draft), num_speculative_tokens=2, **ENGINE)
    engine = _recording_draft_passes(build_engine(str(target), config, connector), connector)
    engine.add_request([5, 6, 7, 8, 9], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), "r")
    engine.step()
    names = [call[0] for call in connector.calls]
    assert names.index("draft_pass") > names.index("get_finished")  # the lifecycle ran, deferred
    assert names.index("wait_for_save") > names.index("draft_pass")  # finalize waited after the draft
    assert names.index("clear_connector_metadata") > names.index("wait_for_save")
    # Finish the request; its blocks stay until the connector reports finished_sending.
    while engine.core.scheduler.num_unfinished:
        engine.step()
    assert engine.num_free_blocks < engine.num_blocks
    connector.report_sending = {"r"}
    engine.step()
    assert engine.num_free_blocks == engine.num_blocks


def test_the_eager_baseline_waits_for_the_targets_save_before_the_draft_pass(
    models: tuple[pathlib.Path, pathlib.Path],
) -> None:
    target, draft = models
    connector = RecordingConnector()
    config = EngineConfig(draft_model=str(draft), num_speculative_tokens=2, kv_save_before_draft=True, **ENGINE)
    engine = _recording_draft_passes(build_engine(str(target), config, connector), connector)
    engine.add_request([5, 6, 7, 8, 9], SamplingParams(temperature=0.0, max_tokens=1), "r")
    engine.step()
    names = [call[0] for call in connector.calls]
    # Eager: a wait for the target's save, then the draft pass, then the finalize's wait.
    first_wait = names.index("wait_for_save")
    assert first_wait < names.index("draft_pass") < len(names) - 1 - names[::-1].index("wait_for_save")


def test_decode_worker_with_a_draft_recomputes_the_draft_kv(models: tuple[pathlib.Path, pathlib.Path]) -> None:
    """In-process stand-in for the disaggregated case: a request whose prompt KV 'arrived'
    (num_computed set as after a pull) makes the draft catch up over the whole prompt."""
    target, draft = models
    prompts = random_prompts([30], seed=9)
    plain = LLM(str(target), **ENGINE).generate(prompts, GREEDY)[0].token_ids
    spec_llm = LLM(str(target), draft_model=str(draft), num_speculative_tokens=3, **ENGINE)
    engine = spec_llm.engine
    # Prefill with the target only, as a prefill worker would, by running one step with
    # the drafter detached; then re-attach it: its KV for the prompt is missing.
    drafter, engine.core.runner.drafter = engine.core.runner.drafter, None
    engine.add_request(prompts[0], GREEDY, "r")
    engine.step()
    request = engine.core.scheduler.requests["r"]
    assert request.num_draft_computed_tokens == 0
    engine.core.runner.drafter = drafter
    tokens: list[int] = list(request.output_token_ids)
    while engine.core.scheduler.num_unfinished:
        for out in engine.step():
            if out.finished:
                tokens = out.token_ids
    assert tokens == plain
    assert engine.num_free_blocks == engine.num_blocks


@pytest.mark.parametrize("num_decode", [1, 2], ids=["1P1D", "1P2D"])
async def test_disaggregated_speculative_greedy_equals_plain_and_frees_everything(
    models: tuple[pathlib.Path, pathlib.Path], num_decode: int
) -> None:
    """1P1D with a draft model on both workers: the prefill worker runs the draft over the prompt
    while its save is in flight and the draft's KV comes with the pull, so the decode worker
    computes none of the prompt's draft KV and speculates; the output equals plain greedy;
    every block is freed."""
    from kvservice.client.client import KVServiceClient
    from kvservice.v1 import kvservice_pb2 as pb
    from kvservice.v1 import kvservice_pb2_grpc as pb_grpc

    target, draft = models
    prompts = random_prompts([7, 33], seed=11)
    plain = LLM(str(target), **ENGINE).generate(prompts, GREEDY)
    worker_args = [
        "--num-blocks",
        "64",
        "--num-threads",
        "1",
        "--draft-model",
        str(draft),
        "--num-speculative-tokens",
        "3",
    ]
    async with local_cluster(str(target), num_prefill=1, num_decode=num_decode, worker_args=worker_args) as cluster:
        async with KVServiceClient(cluster.address) as client:
            for prompt, expected in zip(prompts, plain):
                out = await client.complete(prompt, max_tokens=GREEDY.max_tokens, temperature=0.0, ignore_eos=True)
                assert out.token_ids == expected.token_ids
            cluster_stats = await client.stats()
        decodes = [w.stats for w in cluster_stats.workers if w.stats.role == "decode"]
        prefill = next(w.stats for w in cluster_stats.workers if w.stats.role == "prefill")
        assert sum(d.spec_decode.num_draft_tokens for d in decodes) > 0  # the decode workers did speculate
        assert sum(d.kv_receiving.num_transfers for d in decodes) == len(prompts)  # and pulled, not recomputed
        num_prompt_tokens = sum(map(len, prompts))
        assert prefill.spec_decode.num_draft_prompt_tokens_computed == num_prompt_tokens
        assert sum(d.spec_decode.num_draft_prompt_tokens_received for d in decodes) == num_prompt_tokens
        assert all(d.spec_decode.num_draft_prompt_tokens_recomputed == 0 for d in decodes)
        for address in cluster.prefill_addresses + cluster.decode_addresses:
            import grpc

            async with grpc.aio.insecure_channel(address) as channel:
                stats = await pb_grpc.WorkerStub(channel).Stats(pb.StatsRequest(), timeout=10)
            assert stats.num_blocks_free == stats.num_blocks_total


# ---------------------------------------------------------------- prompt lookup (ngram)

NGRAM = dict(speculative_method="ngram", num_speculative_tokens=3)
# Prompts that repeat themselves, so lookups find matches; and random ones, where they rarely do.
REPETITIVE_PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12] * 4, [100, 200, 300] * 5 + [7], [40, 41, 42, 43] * 6]


def test_greedy_ngram_speculation_equals_plain_greedy(monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = REPETITIVE_PROMPTS + random_prompts([1, 5, 17, 33], seed=3, vocab_size=256)
    plain = LLM("tiny", **ENGINE).generate(prompts, GREEDY)
    llm = LLM("tiny", **NGRAM, **ENGINE)
    num_padded_steps = 0

    def counting_decode_group(items: list[BatchItem], block_size: int) -> tuple[list[int], int]:
        nonlocal num_padded_steps
        group, num_queries = decode_group(items, block_size)
        num_padded_steps += any(len(items[i].token_ids) < num_queries for i in group)
        return group, num_queries

    monkeypatch.setattr(input_batch, "decode_group", counting_decode_group)
    spec = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    # Requests drafted different numbers of tokens, and verified them in one padded group.
    assert num_padded_steps > 0
    scheduler = llm.engine.core.scheduler
    # The counters count lookups as they count a draft's: some proposals accepted, some not.
    assert 0 < scheduler.num_accepted_tokens < scheduler.num_draft_tokens
    assert scheduler.num_verify_steps > 0
    assert llm.engine.num_free_blocks == llm.engine.num_blocks


def test_ngram_needs_no_draft_model_and_keeps_every_kv_block() -> None:
    sized = dict(ENGINE, num_blocks=None, kv_cache_memory_bytes=4 << 20)
    plain = build_engine("tiny", EngineConfig(**sized))
    ngram = build_engine("tiny", EngineConfig(**NGRAM, **sized))
    drafted = build_engine("tiny", EngineConfig(draft_model="tiny", num_speculative_tokens=3, **sized))
    assert isinstance(ngram.core.runner.drafter, NgramProposer) and ngram.core.draft is None
    assert ngram.num_blocks == plain.num_blocks > drafted.num_blocks  # a draft's KV shares the budget
    assert ngram.core.scheduler.num_lookahead_tokens == 0  # no draft pass writes KV ahead


def test_sampled_verification_of_lookups_with_top_k_1_equals_greedy() -> None:
    """The sampling path (rejection sampling with one-hot draft laws) end to end: with top_k=1 the
    target's law is one-hot too, so every draw is the argmax and the output is greedy's."""
    top_1 = SamplingParams(temperature=1.0, top_k=1, max_tokens=GREEDY.max_tokens, seed=7, ignore_eos=True)
    plain = LLM("tiny", **ENGINE).generate(REPETITIVE_PROMPTS, GREEDY)
    llm = LLM("tiny", **NGRAM, **ENGINE)
    spec = llm.generate(REPETITIVE_PROMPTS, top_1)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    scheduler = llm.engine.core.scheduler
    assert 0 < scheduler.num_accepted_tokens < scheduler.num_draft_tokens


def test_rejection_sampling_of_deterministic_drafts_keeps_the_target_distribution() -> None:
    """Prompt lookup proposes fixed tokens (one-hot draft laws, draft_probs=None): the emitted
    tokens still follow p, at the first position and at the second after an acceptance."""
    gen = torch.Generator().manual_seed(0)
    vocab, trials = 6, 12000
    target_logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 0.3], [0.1, 0.2, 1.5, -0.5, 0.9, 0.0], [0.0] * 6])
    drafts = [3, 2]  # p[0][3] is small (mostly rejected), p[1][2] large (mostly accepted)
    params = SamplingParams(temperature=1.0)
    p = target_logits.softmax(-1)
    first = torch.zeros(vocab)
    second_given_accepted = torch.zeros(vocab)
    for _ in range(trials):
        out = verify_draft_tokens(target_logits, drafts, None, params, gen)
        first[out[0]] += 1
        if out[0] == drafts[0]:
            second_given_accepted[out[1]] += 1
    critical = 20.52  # chi-square, 5 degrees of freedom, p = 0.001
    expected = p[0] * trials
    assert float(((first - expected) ** 2 / expected).sum()) < critical
    n = second_given_accepted.sum()
    expected2 = p[1] * n
    assert n > 400 and float(((second_given_accepted - expected2) ** 2 / expected2).sum()) < critical
    # And the test can fail: always accepting, or never, would be far from p.
    uniform = torch.full((vocab,), trials / vocab)
    assert float(((first - uniform) ** 2 / uniform).sum()) > 10 * critical
    assert 0 < first[drafts[0]] < trials


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(speculative_method="ngram"), "speculative_method='ngram' needs num_speculative_tokens > 0"),
        (dict(speculative_method="ngram", num_speculative_tokens=3, draft_model="tiny"), "draft_model='tiny'"),
        (dict(speculative_method="draft", num_speculative_tokens=3), "speculative_method='draft' needs a draft_model"),
        (dict(num_speculative_tokens=3), "num_speculative_tokens=3 needs a speculative_method"),
        (dict(draft_model="tiny"), "speculative_method='draft' (draft_model='tiny') needs num_speculative_tokens > 0"),
        (dict(speculative_method="eagle", num_speculative_tokens=3), "speculative_method must be one of draft, ngram"),
        (dict(speculative_method="ngram", num_speculative_tokens=-1), "num_speculative_tokens must be >= 0"),
        (dict(speculative_method="ngram", num_speculative_tokens=3, prompt_lookup_min=0), "prompt_lookup_min"),
        (dict(speculative_method="ngram", num_speculative_tokens=3, prompt_lookup_max=1), "prompt_lookup_max"),
    ],
)
def test_speculative_config_errors_name_the_field(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        EngineConfig(**fields)  # type: ignore[arg-type]


def test_a_draft_model_alone_means_the_draft_method() -> None:
    assert EngineConfig(draft_model="tiny", num_speculative_tokens=3).speculative_method == "draft"
    assert EngineConfig(speculative_method="ngram", num_speculative_tokens=3).draft_model is None
    assert EngineConfig().speculative_method is None


async def test_disaggregated_ngram_speculation_equals_plain_greedy(models: tuple[pathlib.Path, pathlib.Path]) -> None:
    """1P1D with --speculative-method ngram: the prefill worker runs without it (it samples one
    token), the decode worker looks up and verifies, and the output is plain greedy's."""
    from kvservice.client.client import KVServiceClient

    target, _ = models
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12] * 4, *random_prompts([33], seed=11)]
    plain = LLM(str(target), **ENGINE).generate(prompts, GREEDY)
    worker_args = ["--num-blocks", "64", "--num-threads", "1", "--speculative-method", "ngram"]
    worker_args += ["--num-speculative-tokens", "3"]
    async with local_cluster(str(target), num_prefill=1, num_decode=1, worker_args=worker_args) as cluster:
        async with KVServiceClient(cluster.address) as client:
            for prompt, expected in zip(prompts, plain):
                out = await client.complete(prompt, max_tokens=GREEDY.max_tokens, temperature=0.0, ignore_eos=True)
                assert out.token_ids == expected.token_ids
            cluster_stats = await client.stats()
    workers = {w.stats.role: w.stats for w in cluster_stats.workers}
    assert workers["decode"].spec_decode.num_draft_tokens > 0  # the decode worker did speculate
    assert workers["decode"].spec_decode.num_accepted_tokens > 0
    assert workers["decode"].kv_receiving.num_transfers == len(prompts)  # and pulled, not recomputed
    assert workers["prefill"].spec_decode.num_draft_tokens == 0
