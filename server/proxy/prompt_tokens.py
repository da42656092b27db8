"""The token ids of a request's prompt on the proxy, for routing by what workers cache.

They must be exactly the ids the workers compute (`kvservice.loading.chat_template.encode_prompt`,
with the workers' tokenizer, which `kvservice proxy --model` loads without the weights).
Token-id prompts need nothing; text and chat without a tokenizer give None (the router
then balances by load; logged once), and so does a prompt the workers would refuse: they
report that error, not the proxy.
"""

from __future__ import annotations

import logging

from kvservice.loading.chat_template import encode_prompt
from kvservice.loading.tokenizer import Tokenizer
from kvservice.server.convert import prompt_from_proto
from kvservice.v1 import kvservice_pb2 as pb

logger = logging.getLogger(__name__)


class PromptTokens:
    def __init__(self, tokenizer: Tokenizer | None, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._has_warned = False

    def token_ids(self, request: pb.GenerateRequest) -> list[int] | None:
        if request.WhichOneof("prompt") == "token_ids":
            return list(request.token_ids.ids)
        if self.tokenizer is None:
            if not self._has_warned:
                logger.warning(
                    "text and chat prompts are routed by load only: start the proxy with --model to route them by cache"
                )
                self._has_warned = True
            return None
        try:
            return encode_prompt(self.tokenizer, prompt_from_proto(request, self.max_model_len))
        except ValueError:
            return None
