"""Logprobs in the OpenAI API's two shapes, from the generation service's `pb.Logprobs`.

Completions (the legacy shape lm-evaluation-harness reads): parallel lists `tokens`,
`token_logprobs`, `top_logprobs` (a dict per position: the top tokens and the position's
own token, by text) and `text_offset` (each token's first character in the choice's text;
with `echo`, the prompt's tokens come first and the first of them has no logprob).
Chat completions: `content`, a list of `{token, logprob, bytes, top_logprobs}`.

Each token's text is the token decoded alone, special tokens kept; without a tokenizer
(a proxy started without --model) it is `token_id:<id>`, as vLLM's option names it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvservice.loading.tokenizer import Tokenizer
from kvservice.v1 import kvservice_pb2 as pb

# OpenAI's stand-in for a logprob of -inf (JSON has no infinity).
MIN_LOGPROB = -9999.0


class TokenTexts:
    """Token id -> its text, decoded alone and remembered (a vocabulary is small)."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            if self.tokenizer is None:
                text = f"token_id:{token_id}"
            else:
                text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._texts[token_id] = text
        return text


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


@dataclass(slots=True)
class CompletionLogprobs:
    """The completions shape, built chunk by chunk: `text_offset` runs on across chunks."""

    texts: TokenTexts
    offset: int = 0  # characters of the choice's text before the next token

    def build(self, token_ids: list[int], logprobs: list[pb.Logprobs | None]) -> dict[str, list[Any]]:
        """One entry per token; a None logprob is a position with none (the prompt's first token)."""
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, lp in zip(token_ids, logprobs, strict=True):
            text = self.texts(token_id)
            out["tokens"].append(text)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
            if lp is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(_finite(lp.logprob))
            # Keyed by text: tokens that decode alike (bytes of a split character) keep the best.
            top: dict[str, float] = {}
            for t in lp.top:
                top.setdefault(self.texts(t.token_id), _finite(t.logprob))
            top.setdefault(text, _finite(lp.logprob))  # the position's own token is always listed
            out["top_logprobs"].append(top)
        return out


def chat_logprobs(texts: TokenTexts, logprobs: list[pb.Logprobs]) -> dict[str, list[dict[str, Any]]]:
    """The chat shape: `{"content": [...]}`, one entry per token, its top tokens best first."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = texts(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t.token_id, t.logprob) for t in lp.top]}
            for lp in logprobs
        ]
    }
