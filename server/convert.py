"""The one place that translates between protobuf messages and engine objects."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvservice.core.block_pool import OFFLOAD_TIER, KVCacheEvent
from kvservice.core.logprobs import TokenLogprobs
from kvservice.core.sampling_params import MAX_STOP_TOKEN_IDS, SamplingParams
from kvservice.core.structured_output import StructuredOutputParams
from kvservice.loading.chat_template import ChatPrompt, Prompt, ResumedPrompt
from kvservice.runtime.finish_reason import finish_reason_to_proto
from kvservice.v1 import kvservice_pb2 as pb

if TYPE_CHECKING:  # the engine (torch) only where one runs, not in the proxy
    from kvservice.engine.engine import RequestOutput

DEFAULT_MAX_TOKENS = 16


def check_stop_token_ids_count(sp: pb.SamplingParams) -> None:
    """Counted before anything converts or copies them: a million ids would stall the event loop."""
    if len(sp.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(
            f"sampling_params.stop_token_ids: {len(sp.stop_token_ids)} ids, at most {MAX_STOP_TOKEN_IDS} are allowed"
        )


def sampling_params_from_proto(sp: pb.SamplingParams) -> SamplingParams:
    """Absent fields take their defaults; zero is a real value (greedy), never "unset"."""
    check_stop_token_ids_count(sp)
    try:
        return SamplingParams(
            temperature=sp.temperature if sp.HasField("temperature") else 1.0,
            top_p=sp.top_p if sp.HasField("top_p") else 1.0,
            top_k=sp.top_k if sp.HasField("top_k") else -1,
            max_tokens=sp.max_tokens if sp.HasField("max_tokens") else DEFAULT_MAX_TOKENS,
            seed=sp.seed if sp.HasField("seed") else None,
            stop_token_ids=tuple(sp.stop_token_ids),
            ignore_eos=sp.ignore_eos,
            stop=tuple(sp.stop),
            logprobs=sp.logprobs if sp.HasField("logprobs") else None,
            prompt_logprobs=sp.prompt_logprobs if sp.HasField("prompt_logprobs") else None,
            structured_output=structured_output_from_proto(sp.structured_output)
            if sp.HasField("structured_output")
            else None,
            n=sp.n if sp.HasField("n") else 1,
        )
    except ValueError as e:
        raise ValueError(f"sampling_params.{e}") from None


def structured_output_from_proto(so: pb.StructuredOutput) -> StructuredOutputParams:
    kind = so.WhichOneof("constraint")
    if kind is None:
        raise ValueError("structured_output: set one of json_schema, json_object, regex, choice or grammar")
    if kind == "choice":
        return StructuredOutputParams(choice=tuple(so.choice.choices))
    return StructuredOutputParams(**{kind: getattr(so, kind)})


def structured_output_to_proto(params: StructuredOutputParams, so: pb.StructuredOutput) -> None:
    """Fill `so` (a field of a request being built) from `params`."""
    if params.json_schema is not None:
        so.json_schema = params.json_schema
    elif params.json_object:
        so.json_object = True
    elif params.regex is not None:
        so.regex = params.regex
    elif params.choice is not None:
        so.choice.choices.extend(params.choice)
    else:
        assert params.grammar is not None  # StructuredOutputParams holds exactly one constraint
        so.grammar = params.grammar


def check_prompt_length(request: pb.GenerateRequest, max_model_len: int) -> None:
    """Refuse a prompt of token ids too long for the model, before anything converts or
    copies it (millions of ids would stall the event loop)."""
    if request.WhichOneof("prompt") != "token_ids":
        return
    num_tokens = len(request.token_ids.ids)
    if num_tokens >= max_model_len:
        raise ValueError(
            f"prompt: {num_tokens} tokens, but the model's maximum length is {max_model_len} "
            "(prompt plus at least one generated token)"
        )


def prompt_from_proto(request: pb.GenerateRequest, max_model_len: int) -> Prompt:
    """The request's prompt; with `resume_token_ids` (a migrated stream), resumed after them."""
    prompt = _base_prompt(request, max_model_len)
    if request.resume_token_ids:
        if len(request.resume_token_ids) >= max_model_len:
            raise ValueError(
                f"resume_token_ids: {len(request.resume_token_ids)} tokens, "
                f"but the model's maximum length is {max_model_len}"
            )
        return ResumedPrompt(prompt, list(request.resume_token_ids))
    return prompt


def _base_prompt(request: pb.GenerateRequest, max_model_len: int) -> str | list[int] | ChatPrompt:
    kind = request.WhichOneof("prompt")
    if kind == "text":
        if not request.text:
            raise ValueError("prompt: empty text")
        return request.text
    if kind == "token_ids":
        check_prompt_length(request, max_model_len)
        return list(request.token_ids.ids)
    if kind == "chat":
        chat = request.chat
        if not chat.messages:
            raise ValueError("prompt.chat.messages: empty conversation")
        messages = [{"role": m.role, "content": m.content} for m in chat.messages]
        add_generation_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
        return ChatPrompt(messages, add_generation_prompt)
    raise ValueError("prompt: set one of text, token_ids or chat")


def response_from_output(output: RequestOutput, is_first: bool) -> pb.GenerateResponse:
    """The output's new tokens as one chunk; a sequence's first chunk also carries what the
    prompt gave (its logprobs when asked for, its prefix-cache hit)."""
    response = pb.GenerateResponse(
        request_id=output.request_id,
        token_ids=output.new_token_ids,
        text=output.new_text,
        finish_reason=finish_reason_to_proto(output.finish_reason),
        num_prompt_tokens=len(output.prompt_token_ids),
        index=output.index,
    )
    if output.new_logprobs:
        response.logprobs.extend(logprobs_to_proto(output.new_logprobs))
    if is_first:
        if output.prompt_logprobs is not None:
            response.prompt_logprobs.extend(logprobs_to_proto(output.prompt_logprobs))
            response.prompt_token_ids.extend(output.prompt_token_ids)
        if output.num_cached_tokens is not None:
            response.num_cached_tokens = output.num_cached_tokens
    return response


def logprobs_to_proto(logprobs: list[TokenLogprobs]) -> list[pb.Logprobs]:
    return [
        pb.Logprobs(
            token_id=lp.token_id,
            logprob=lp.logprob,
            rank=lp.rank,
            top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
        )
        for lp in logprobs
    ]


def kv_event_to_proto(event: KVCacheEvent) -> pb.KVCacheEvent:
    tier = pb.KV_TIER_OFFLOAD if event.tier == OFFLOAD_TIER else pb.KV_TIER_CACHE
    if event.kind == "stored":
        stored = pb.KVBlocksStored(block_hashes=event.block_hashes, parent_hash=event.parent_hash)
        return pb.KVCacheEvent(stored=stored, tier=tier)
    assert event.kind == "removed", event.kind
    return pb.KVCacheEvent(removed=pb.KVBlocksRemoved(block_hashes=event.block_hashes), tier=tier)
