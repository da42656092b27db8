"""The scheduler's half of asynchronous KV loads: a waiting request whose KV a connector
supplies parks in WAITING_FOR_REMOTE_KV with its blocks, and resumes (or recomputes, or fails)
when the connector reports the load done. No torch.

A decode worker's loads bring the prompt's KV and the first token its prefill worker sampled;
a colocated worker's prompt lane (`kvservice.worker.prompt_lane`) brings the KV of all the
request's tokens but the last, which the next step computes, its logits giving the next token.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from kvservice.connector.base import KVConnectorBase
from kvservice.core.kv_cache_manager import KVCacheManager
from kvservice.core.outputs import EngineCoreOutput, KVConnectorOutput, request_output
from kvservice.core.request import Request, RequestStatus


class RemoteKVLoads:
    """Mixed into `Scheduler`, whose queues and cache it moves requests between."""

    kv: KVCacheManager
    connector: KVConnectorBase | None
    kv_load_failure_policy: str
    vocab_size: int | None
    waiting: deque[Request]
    running: list[Request]
    waiting_for_remote_kv: dict[str, Request]
    pending_free: dict[str, Request]

    if TYPE_CHECKING:  # the scheduler's own, declared for the type checker only

        def _admit(self, request: Request, num_cached: int) -> None: ...

        def _finish(self, request: Request, status: RequestStatus) -> None: ...

        def _release(self, request: Request) -> None: ...

        def _fail(self, request: Request, error: str) -> list[EngineCoreOutput]: ...

    def _try_start_remote_load(self, request: Request, cached: list[int]) -> bool | None:
        """Park a request whose prompt KV (past its cached prefix) arrives asynchronously.
        True if it was parked, None if it must but its blocks are not free, else False."""
        if self.connector is None:
            return False
        num_cached = len(cached) * self.kv.block_size
        num_external, is_async = self.connector.get_num_new_matched_tokens(request, num_cached)
        if not is_async:
            return False
        block_ids = self.kv.allocate_slots(request, num_external, cached)
        if block_ids is None:
            return None
        self._admit(request, num_cached)
        self.connector.update_state_after_alloc(request, block_ids, num_external)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.waiting_for_remote_kv[request.request_id] = request
        return True

    def _update_from_connector(self, output: KVConnectorOutput) -> list[EngineCoreOutput]:
        assert self.connector is not None
        self.connector.update_connector_output(output)
        outputs: list[EngineCoreOutput] = []
        failed = self.kv.requests_holding(output.invalid_block_ids, self.waiting_for_remote_kv)
        first_token_ids = output.kv_connector_worker_meta.first_token_ids if output.kv_connector_worker_meta else {}
        for request_id in output.finished_sending | output.finished_recving:
            pending = self.pending_free.pop(request_id, None)
            if pending is not None:
                self._release(pending)
        for request_id in output.finished_recving:
            request = self.waiting_for_remote_kv.pop(request_id, None)
            if request is None:
                continue
            first_token = first_token_ids.get(request_id)
            if first_token is None:  # a prompt lane's load brings none; a prefill's that never came failed
                is_bad = self.connector.supplies_first_token(request)
            else:
                is_bad = not 0 <= first_token < (self.vocab_size or 1 << 62)
            if request_id in failed or is_bad:
                outputs.extend(self._handle_load_failure(request))
                continue
            outputs.extend(self._resume_after_load(request, first_token))
        return outputs

    def _resume_after_load(self, request: Request, first_token: int | None) -> list[EngineCoreOutput]:
        """The prompt's KV is in place: continue from the first token the prefill sampled or,
        without one (a colocated worker's prompt lane loads all tokens but the last), from the
        last token, whose logits give the next one."""
        request.num_computed_tokens = request.num_tokens - (first_token is None)
        request.num_draft_computed_tokens = 0  # the draft's KV is recomputed here
        request.kv_transfer_params = None
        self.kv.cache_full_blocks(request)
        status = None
        if first_token is not None:
            request.append_output_token(first_token)
            status = request.check_stop()
        if status is not None:
            self._finish(request, status)
        else:
            request.status = RequestStatus.RUNNING
            self.running.append(request)
        if first_token is None:
            return []
        # The first token's logprobs (and the prompt's) are the prefill worker's to report.
        return [request_output(request, [first_token], status, None, is_first=True)]

    def _handle_load_failure(self, request: Request) -> list[EngineCoreOutput]:
        request.kv_transfer_params = None
        if self.kv_load_failure_policy == "recompute":
            # Start over as a local prefill: the loaded blocks hold nothing valid, and the
            # cached prefix it shares may end where the prompt does, but its last token
            # must now be computed (never into a shared block).
            self.kv.free(request.request_id)
            request.num_computed_tokens = 0
            request.num_draft_computed_tokens = 0
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)
            return []
        return self._fail(
            request, "loading the prompt's KV from the prefill worker failed (kv_load_failure_policy=fail)"
        )
