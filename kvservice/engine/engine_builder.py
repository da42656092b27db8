"""Assembles an engine from its config: loads the target (and draft) model, sizes and allocates
the KV cache, and wires the prompt lane, scheduler, step budget, grammars, runner, core lease
and step trace. Construction lives here so `EngineCore` and `LLMEngine` only step and serve."""

from __future__ import annotations

import functools
import pathlib
from typing import Protocol

import torch

from kvservice.config import EngineConfig, ModelConfig
from kvservice.connector.base import KVConnectorBase
from kvservice.core.block_hash import hash_seed
from kvservice.core.kv_cache_manager import KVCacheManager
from kvservice.engine.engine import LLMEngine
from kvservice.engine.engine_core import EngineCore
from kvservice.engine.output_processor import OutputProcessor
from kvservice.engine.scheduler import Scheduler
from kvservice.engine.step_budget import StepTimeBudget
from kvservice.engine.step_trace import StepTrace
from kvservice.engine.tier_loads import KVTierIO
from kvservice.loading.model_files import load_model_config
from kvservice.loading.model_loader import LoadedModel, load_model, resolve_dtype
from kvservice.model.kv_cache import KVCacheLayout, allocate_kv_caches
from kvservice.model.kv_dtype import kv_storage_dtype
from kvservice.structured.grammar import GrammarCompiler
from kvservice.worker.core_lease import CoreLease, LeaseRole
from kvservice.worker.draft_proposer import DraftLayerHooks, DraftProposer
from kvservice.worker.grammar_masks import GrammarMasks
from kvservice.worker.input_batch import MAX_DECODE_GROUP_QUERIES
from kvservice.worker.model_runner import ModelRunner
from kvservice.worker.ngram_proposer import NgramProposer
from kvservice.worker.prompt_lane import PromptLane
from kvservice.worker.proposer import Proposer


class KVTier(KVTierIO, Protocol):
    """An offload tier as the builder wires it: the engine's KV caches registered first."""

    def register_kv_caches(self, kv_caches: list[torch.Tensor], layout: KVCacheLayout) -> None: ...


def build_engine(
    model: str,
    config: EngineConfig,
    connector: KVConnectorBase | None = None,
    core_lease: CoreLease | None = None,
    kv_tier: KVTier | None = None,
) -> LLMEngine:
    """An engine serving `model` ("tiny", "smollm2", a model directory or a GGUF file).

    `connector` moves KV to or from other workers; `core_lease` makes steps take turns on the
    cores with another worker (see `CoreLease`); `kv_tier` keeps evicted blocks and gives missed prefixes back
    (`kvservice.connector.offload_tier`)."""
    core = build_engine_core(model, config, connector, core_lease, kv_tier)
    return LLMEngine(core, build_output_processor(core))


def build_engine_core(
    model: str,
    config: EngineConfig,
    connector: KVConnectorBase | None = None,
    core_lease: CoreLease | None = None,
    kv_tier: KVTier | None = None,
) -> EngineCore:
    max_model_len = config.max_model_len or load_model_config(model).max_position_embeddings
    loaded = load_model(model, config.dtype, config.device, rotary_positions(max_model_len))
    kv_dtype = functools.partial(kv_storage_dtype, config.kv_cache_dtype)
    layout = KVCacheLayout.for_model(loaded.config, config.block_size, kv_dtype(loaded.dtype))
    draft = _load_draft(config, loaded, max_model_len)
    draft_layout = (
        None if draft is None else KVCacheLayout.for_model(draft.config, config.block_size, kv_dtype(draft.dtype))
    )
    bytes_per_block = layout.bytes_per_block + (0 if draft_layout is None else draft_layout.bytes_per_block)
    num_blocks = config.num_blocks or max(1, config.kv_cache_memory_bytes // bytes_per_block)
    kv_caches = allocate_kv_caches(layout, num_blocks, loaded.device)
    # Same block ids as the target's cache: one allocation serves both.
    draft_caches = (
        [] if draft is None or draft_layout is None else allocate_kv_caches(draft_layout, num_blocks, draft.device)
    )
    prompt_lane = None
    if config.prompt_lane:
        prompt_lane = PromptLane(
            loaded.model, kv_caches, config.block_size, loaded.device, config.max_num_batched_tokens
        )
    draft_hooks = None
    if connector is not None:
        transfer_layout = layout
        if draft is not None and config.draft_model is not None:
            transfer_layout = _with_draft(layout, config.draft_model, draft.config, kv_dtype(draft.dtype))
        draft_hooks = _register_kv_caches(connector, transfer_layout, kv_caches + draft_caches)
    kv_hash_seed = hash_seed(model, str(layout.dtype))  # the KV's dtype: "auto" keeps the model's
    scheduler = _build_scheduler(
        config, num_blocks, kv_hash_seed, loaded.config.vocab_size, connector, prompt_lane, kv_tier
    )
    if kv_tier is not None:
        kv_tier.register_kv_caches(kv_caches, layout)
        scheduler.kv.block_pool.record_evictions = True
    drafter: Proposer | None = None
    if draft is not None:
        drafter = DraftProposer(
            draft.model, draft_caches, config.block_size, config.num_speculative_tokens, draft.device, draft_hooks
        )
    elif config.speculative_method == "ngram":  # no model, no KV: the cache keeps all its blocks
        drafter = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_max, config.prompt_lookup_min)
    eos_token_ids = sorted(loaded.config.eos_token_ids)
    grammar_compiler = functools.cache(
        lambda: GrammarCompiler(loaded.tokenizer, loaded.config.vocab_size, eos_token_ids)
    )
    runner = ModelRunner(
        loaded.model,
        kv_caches,
        layout,
        loaded.device,
        config.seed,
        connector,
        drafter,
        GrammarMasks(grammar_compiler),
        core_lease.pause if core_lease is not None and core_lease.role is LeaseRole.YIELDING else None,
        config.kv_save_before_draft,
    )
    step_trace = StepTrace.from_env()
    if core_lease is not None and step_trace is not None:
        core_lease.turn_log = step_trace.turns
        step_trace.lease_role = core_lease.role.value
    return EngineCore(
        config, loaded, draft, layout, kv_caches, scheduler, runner, connector, prompt_lane, core_lease,
        step_trace, grammar_compiler, kv_hash_seed, max_model_len, kv_tier,
    )  # fmt: skip


def build_output_processor(core: EngineCore) -> OutputProcessor:
    """The request bookkeeping in front of `core`: its tokenizer, end tokens and length limit."""
    return OutputProcessor(core.loaded.tokenizer, frozenset(core.model_config.eos_token_ids), core.max_model_len)


def kv_transfer_layout(model: str, config: EngineConfig) -> KVCacheLayout:
    """This worker's KV as a transfer moves it: the target's layers, then a draft model's where
    its KV has the target's geometry (so the draft's prompt KV travels on the same pull)."""
    target_config = load_model_config(model)

    def kv_dtype(model_config: ModelConfig) -> torch.dtype:
        return kv_storage_dtype(config.kv_cache_dtype, resolve_dtype(config.dtype, model_config))

    layout = KVCacheLayout.for_model(target_config, config.block_size, kv_dtype(target_config))
    if config.draft_model is None:
        return layout
    draft_config = load_model_config(config.draft_model)
    return _with_draft(layout, config.draft_model, draft_config, kv_dtype(draft_config))


def draft_fingerprint(draft_model: str, config: ModelConfig) -> str:
    """What a prefill and a decode worker compare to agree they run the same draft: its name
    and shape (layers, widths, KV heads, vocabulary)."""
    name = pathlib.Path(draft_model).name or draft_model
    shape = (config.num_hidden_layers, config.hidden_size, config.intermediate_size, config.num_key_value_heads)
    return f"{name} (layers, hidden, ffn, kv heads = {shape}, vocab {config.vocab_size})"


def _with_draft(
    layout: KVCacheLayout, draft_model: str, draft_config: ModelConfig, draft_dtype: torch.dtype
) -> KVCacheLayout:
    """The target's `layout` followed by the draft's layers where its KV has the same geometry."""
    draft = KVCacheLayout.for_model(draft_config, layout.block_size, draft_dtype)
    return layout.with_draft(draft, draft_fingerprint(draft_model, draft_config)) or layout


def _register_kv_caches(
    connector: KVConnectorBase, layout: KVCacheLayout, kv_caches: list[torch.Tensor]
) -> DraftLayerHooks | None:
    """Hand the connector its caches: the target's, and the draft's after them where the
    connector moves the draft's KV too. Returns the hooks the draft's forward saves through."""
    if not connector.moves_draft_kv:
        connector.register_kv_caches(kv_caches[: layout.num_target_layers], layout.target)
        return None
    if layout.num_draft_layers == 0:
        raise ValueError("the KV connector moves a draft's KV, but this engine's draft KV has another geometry")
    connector.register_kv_caches(kv_caches, layout)
    return DraftLayerHooks(connector, layout.num_target_layers)


def rotary_positions(max_model_len: int) -> int:
    """The positions a model's rotary tables cover: past `max_model_len`, the padding queries a
    decode group may run after a request's last token (`input_batch.decode_group`)."""
    return max_model_len + MAX_DECODE_GROUP_QUERIES


def _load_draft(config: EngineConfig, target: LoadedModel, max_model_len: int) -> LoadedModel | None:
    """The speculative draft model, which must share the target's vocabulary."""
    if config.draft_model is None:
        return None
    draft = load_model(config.draft_model, config.dtype, config.device, rotary_positions(max_model_len))
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"draft_model: vocabulary of {draft.config.vocab_size} tokens, the target's has {target.config.vocab_size}"
        )
    return draft


def _build_scheduler(
    config: EngineConfig,
    num_blocks: int,
    kv_hash_seed: int,
    vocab_size: int,
    connector: KVConnectorBase | None,
    prompt_lane: PromptLane | None,
    kv_tier: KVTierIO | None,
) -> Scheduler:
    step_budget = None
    if config.step_target_ms is not None:
        step_budget = StepTimeBudget(
            config.step_target_ms / 1000,
            config.max_prefill_tokens_with_decode or config.max_num_batched_tokens,
            config.max_num_batched_tokens,
        )
    return Scheduler(
        KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, kv_hash_seed),
        config.max_num_seqs,
        config.max_num_batched_tokens,
        connector,
        config.kv_load_failure_policy,
        vocab_size,
        # The draft model's pass writes KV past the scheduled tokens; prompt lookup writes none.
        config.num_speculative_tokens if config.speculative_method == "draft" else 0,
        config.max_prefill_tokens_with_decode,
        step_budget,
        prompt_lane,
        has_draft_model=config.draft_model is not None,
        kv_tier=kv_tier,
    )
