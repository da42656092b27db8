"""Llama-family decoder (Llama 2/3, Qwen2, Mistral) in plain PyTorch over a paged KV cache.

Module names mirror Hugging Face's, except that q/k/v and gate/up are fused into one
matmul each (`fuse_checkpoint_weights` maps a checkpoint's state dict onto them).
The forward takes a flat batch of tokens ([T]) from many requests; attention reads
and writes the paged cache through `AttentionMetadata`. On CPU, when the C++ kernels
are loaded (`kvservice.model.cpu_kernels`), the residual add + RMSNorm, the rotary
embedding and SwiGLU's activation run as one call each, and a GGUF model's matmuls of a few rows read its
block-quantized weights (`kvservice.model.block_quant`); the PyTorch formulas here are the fallback.
A KV connector, when given, is called around each layer through `LayerKVHooks`:
`wait_for_layer_load` before, `save_kv_layer` after.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import torch
from torch import nn

from kvservice.config import ModelConfig
from kvservice.model.attention import AttentionMetadata, LayerKVHooks, paged_attention, write_kv
from kvservice.model.block_quant import BlockQuantWeight
from kvservice.model.cpu_kernels import kernels_loaded
from kvservice.model.fused_decode import DecodeLayerArgs, run_decode_layers
from kvservice.model.greedy_head import MIN_ROWS as GREEDY_HEAD_MIN_ROWS
from kvservice.model.greedy_head import GreedyHead
from kvservice.model.rotary import RotaryEmbedding, StepRope


def has_native_bf16_matmul() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16/AMX) through oneDNN."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported"):
        return False
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def is_block_quant_faster(dtype: torch.dtype) -> bool:
    """Whether a `dtype` model on this CPU should compute over block-quantized weights: float32,
    and bfloat16 where its matmuls are emulated (it computes with a float32 copy then, the
    matmul the kernel was measured against)."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and not has_native_bf16_matmul())


def _can_pack_weights() -> bool:
    """oneDNN's prepacked linear (the ops inductor's CPU freezing uses) is in this torch build."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


# Called between a prompt step's matmuls with the name of what runs next (the same names in every layer).
Pause = Callable[[str], None]


class Linear(nn.Linear):
    """nn.Linear whose matmul may use a copy of the weight prepared once for the CPU.

    `prepare` sets `compute_weight`: the weight widened to float32 (bfloat16 models on a
    CPU without bfloat16 matmuls, where torch's emulated bfloat16 GEMM is 4-15x slower
    than float32; the products of bfloat16 values are exact in float32 and both
    accumulate in float32), and/or packed once in oneDNN's blocked layout (the LM head:
    16 x 576 x 49152 on one core, ~40 -> ~22 ms). The parameter itself stays as loaded;
    call `prepare` again if it changes.
    """

    compute_weight: torch.Tensor | None = None
    compute_bias: torch.Tensor | None = None
    is_packed: bool = False
    # The same weight in GGUF's block quantization, used for every input when the C++ kernels are
    # loaded (see `kvservice.model.block_quant`). SmolLM2's projections, 2 Zen 4 cores: it matches or
    # beats oneDNN's float32 GEMM at every row count (1 row: 53 vs 25 GFLOP/s; 81 rows, a decode
    # batch plus a prompt chunk: 193-216 vs 139-148; 512 rows: 203-224 vs 187-193).
    block_quant: BlockQuantWeight | None = None

    def prepare(self, widen: bool, pack: bool, batch_hint: int) -> None:
        weight = self.weight.detach().float() if widen else self.weight.detach()
        bias = None if self.bias is None else (self.bias.detach().float() if widen else self.bias.detach())
        if pack:
            weight = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        self.compute_weight, self.compute_bias, self.is_packed = weight, bias, pack

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.block_quant is not None and x.dim() == 2 and kernels_loaded():
            return self.block_quant.linear(x, self.bias)
        weight = self.compute_weight
        if weight is None:
            return nn.functional.linear(x, self.weight, self.bias)
        x_in = x.to(weight.dtype)
        if self.is_packed:
            y = torch.ops.mkldnn._linear_pointwise(x_in, weight, self.compute_bias, "none", [], "")
        else:
            y = nn.functional.linear(x_in, weight, self.compute_bias)
        return y.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32, then scale in the model's dtype (as the reference does).
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        bias = cfg.attention_bias
        # q, k and v in one matmul (the loader concatenates the checkpoint's three).
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        # Llama's attention_bias covers o_proj too; Qwen2's biases stop at q/k/v.
        o_bias = bias and cfg.architecture == "llama"
        self.o_proj = Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=o_bias)

    def attend(self, x: torch.Tensor, rope: StepRope, kv_layer: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q, k, v of `x`, k and v written to the cache, attention over it: [T, Hq * D], before `o_proj`."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hkv) * D]
        rope.apply_(qkv, self.num_heads + self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        write_kv(kv_layer, k, v, meta.slot_mapping)
        return paged_attention(q, k, v, kv_layer, meta).view(num_tokens, self.num_heads * self.head_dim)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # gate and up in one matmul (the loader concatenates the checkpoint's two).
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Embedding(nn.Module):
    """nn.Embedding's lookup without its random init: the weights always come from a
    checkpoint (or the tiny model's seeded init), and nn.Embedding's init, built on the meta
    device, imports torch._dynamo (about a second of every server's start-up)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(input_ids, self.weight)


class DecoderStack(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """The decoder plus its LM head; `forward` returns final hidden states [T, hidden]."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderStack(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg, max_positions)
        self._decode_args: DecodeLayerArgs | bool | None = None  # built on the first decode step (False: none)
        self._greedy_head: GreedyHead | None = None  # set by prepare_for_cpu where it runs

    @torch.inference_mode()
    def prepare_for_cpu(self, batch_hint: int) -> None:
        """Prepare matmul weights for this CPU (see `Linear`); `batch_hint`: typical rows per matmul.

        float32: the LM head is packed; packing the other layers measured no gain.
        bfloat16 without hardware support: every layer computes with a float32 copy of
        its weight (memory: +4 bytes a parameter, for a 2.7x faster decode step).
        A layer the block-quantized kernel serves (every row count) gets no copy: it would
        never be read (SmolLM2: 108 MiB and 49 ms of start-up for the packed LM head).
        A float32 model whose LM head is block-quantized gets its greedy head where the CPU
        has AVX2 or AVX-512 (`greedy_tokens`; SmolLM2: ~31 MiB, ~0.2 s).
        """
        dtype = self.model.embed_tokens.weight.dtype
        head = self.lm_head.block_quant
        self._greedy_head = None
        if (
            head is not None
            and dtype == torch.float32
            and kernels_loaded()
            and torch.ops.kvservice.greedy_head_supported()
        ):
            self._greedy_head = GreedyHead.build(head)  # greedy batches' tokens without every logit
        if dtype not in (torch.float32, torch.bfloat16) or not _can_pack_weights():
            return
        widen = dtype == torch.bfloat16 and not has_native_bf16_matmul()
        for name, module in self.named_modules():
            if not isinstance(module, Linear) or (module.block_quant is not None and kernels_loaded()):
                continue
            if widen or name == "lm_head":
                module.prepare(widen, pack=name == "lm_head", batch_hint=batch_hint)

    def use_block_quant(self, weights: dict[str, BlockQuantWeight]) -> None:
        """Give each named `Linear` its weight's block-quantized copy (float32 and bfloat16
        models: the kernel's weight values are the model's, bit for bit)."""
        assert self.model.embed_tokens.weight.dtype in (torch.float32, torch.bfloat16)
        for name, weight in weights.items():
            module = self.get_submodule(name)
            assert isinstance(module, Linear) and weight.shape == tuple(module.weight.shape), name
            module.block_quant = weight
        self._decode_args = None  # rebuilt with these weights
        self._greedy_head = None  # built from the old LM head: prepare_for_cpu builds it again

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        connector: LayerKVHooks | None = None,
        pause: Pause | None = None,
    ) -> torch.Tensor:
        """Final hidden states [T, hidden]. `pause` runs at each of `forward_steps`' pause points,
        told what runs next: a worker sharing its cores hands them over there (`CoreLease`)."""
        steps = self.forward_steps(input_ids, positions, kv_caches, meta, connector)
        while True:
            try:
                next_op = next(steps)
            except StopIteration as done:
                return done.value
            if pause is not None:
                pause(next_op)

    @torch.inference_mode()
    def forward_steps(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        connector: LayerKVHooks | None = None,
    ) -> Generator[str, None, torch.Tensor]:
        """`forward`, resumable: yields between the per-op path's matmuls (four points a layer,
        each the name of what runs next, the same in every layer) and returns the final hidden
        states. Whoever drives it may run other steps between two resumptions (`PromptLane`)."""
        h = self.model.embed_tokens(input_ids)  # the residual stream [T, hidden], updated in place
        fused = h.device.type == "cpu" and kernels_loaded()
        rope = self.rotary(positions, h.dtype, fused)
        layers = self.model.layers
        x = _add_rms_norm_(h, None, layers[0].input_layernorm, fused)
        decode_layers = self._decode_layer_args(meta) if fused else None
        if decode_layers is not None:
            return run_decode_layers(
                decode_layers, h, x, (positions, rope.cos_table, rope.sin_table), kv_caches, meta, connector
            )
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            if connector is not None:
                connector.wait_for_layer_load(i)
            attended = attn.attend(x, rope, kv_caches[i], meta)
            if connector is not None:
                connector.save_kv_layer(i, kv_caches[i], meta)
            yield "o_proj"
            x = _add_rms_norm_(h, attn.o_proj(attended), layer.post_attention_layernorm, fused)
            yield "mlp"
            gate_up = mlp.gate_up_proj(x)
            yield "down_proj"
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            x = _add_rms_norm_(h, mlp.down_proj(_silu_mul(gate_up, fused)), next_norm, fused)
            yield "attention"
        return x

    def _decode_layer_args(self, meta: AttentionMetadata) -> DecodeLayerArgs | None:
        """The layers' static arguments of `decode_layer_` / `decode_layers_` when this step can run
        its layers in C++: decode queries only, every projection block-quantized. None: the per-op path."""
        if meta.prefills or meta.decode_block_table is None:
            return None
        if self._decode_args is None:
            per_layer = self._build_decode_layer_args()
            self._decode_args = DecodeLayerArgs.of(per_layer) if per_layer else False
        return self._decode_args if isinstance(self._decode_args, DecodeLayerArgs) else None

    def _build_decode_layer_args(self) -> list[tuple[Any, ...]] | None:
        """Per layer: the weights, norms and shapes `decode_layer_` takes; None unless every
        projection of every layer is block-quantized."""
        layers = self.model.layers
        args: list[tuple[Any, ...]] = []
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            weights = [p.block_quant for p in projections]
            if any(w is None for w in weights):
                return None
            qkv_w, o_w, gate_up_w, down_w = ([w.codes, w.scales, w.mins] for w in weights if w is not None)
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            post_norm = layer.post_attention_layernorm
            args.append(
                (
                    qkv_w,
                    attn.qkv_proj.bias,
                    o_w,
                    attn.o_proj.bias,
                    gate_up_w,
                    down_w,
                    post_norm.weight,
                    post_norm.eps,
                    next_norm.weight,
                    next_norm.eps,
                    attn.num_heads,
                    attn.num_kv_heads,
                    attn.head_dim,
                )
            )
        return args

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab]."""
        return self.lm_head(hidden).float()

    @torch.inference_mode()
    def greedy_tokens(self, hidden: torch.Tensor) -> list[int] | None:
        """Each row's argmax of `compute_logits(hidden)`, the same tokens, without every logit
        (`kvservice.model.greedy_head`); None where that does not run (then compute the logits)."""
        head = self._greedy_head
        if (
            head is None
            or hidden.shape[0] < GREEDY_HEAD_MIN_ROWS
            or hidden.dtype != torch.float32
            or not kernels_loaded()
        ):
            return None
        return head.tokens(hidden)


def _silu_mul(gate_up: torch.Tensor, fused: bool) -> torch.Tensor:
    """SwiGLU's activation silu(gate) * up of the fused [T, 2I] gate/up projection."""
    if fused:
        return torch.ops.kvservice.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return nn.functional.silu(gate).mul_(up)  # in place: one [T, I] tensor fewer (2,048 rows: 1.96 -> 1.71 ms)


def _add_rms_norm_(residual: torch.Tensor, x: torch.Tensor | None, norm: RMSNorm, fused: bool) -> torch.Tensor:
    """residual += x (in place, when given); returns norm(residual)."""
    if fused:
        return torch.ops.kvservice.add_rms_norm_(residual, x, norm.weight, norm.eps)
    if x is not None:
        residual.add_(x)
    return norm(residual)


def fuse_checkpoint_weights(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """A Hugging Face state dict with q/k/v and gate/up concatenated for the fused layers."""
    fused = dict(state)
    for i in range(num_layers):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        for kind in ("weight", "bias"):
            names = [f"{attn}{p}_proj.{kind}" for p in ("q", "k", "v")]
            if all(n in fused for n in names):
                fused[f"{attn}qkv_proj.{kind}"] = torch.cat([fused.pop(n) for n in names], dim=0)
        names = [f"{mlp}gate_proj.weight", f"{mlp}up_proj.weight"]
        if all(n in fused for n in names):
            fused[f"{mlp}gate_up_proj.weight"] = torch.cat([fused.pop(n) for n in names], dim=0)
    return fused
