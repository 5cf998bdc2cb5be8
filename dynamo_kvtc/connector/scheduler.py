"""The scheduler half of the connector: matches requests against the compressed tiers and plans loads and saves.

It owns no KV bytes. Matching asks the worker's store (in the same process, or over the lookup channel when the
workers are separate processes); block keys are Dynamo's chained XXH3 sequence hashes of the request's tokens, so
what is matched here is exactly what the router hears about.

Saves follow vLLM's block life: a request's prompt blocks are saved in the step its prefill completes (the raw window
on its tail), decode blocks once ``flush_tokens`` new tokens filled blocks, and a finished request's remaining full
blocks in the step after it finished (vLLM holds the blocks until the worker has copied them out).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..tiers.keys import block_hashes, chain
from .config import ConnectorConfig
from .handoff.policy import RemotePrefill
from .lookup import Matcher
from .protocol import LoadOp, SaveOp, StepPlan

log = logging.getLogger(__name__)


@dataclass
class _Req:
    request: Any
    block_ids: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    saved: int = 0  # blocks [0, saved) are stored (or were handed to the worker to store)
    prompt_saved: bool = False
    local: int = 0  # block-aligned locally computed tokens at the last lookup
    asynchronous: bool = False  # what the last lookup told vLLM (must match the load we plan)
    load: LoadOp | None = None


class KvtcScheduler:
    """The scheduler half: one object per engine, answering every scheduler-side vLLM hook.

    Owns the per-request bookkeeping (hashes, what was saved, pending loads) and the plan shipped to the workers each
    step. It asks the worker's store through ``lookup`` (in-process or over the lookup channel) and consults the
    injected ``remote`` policy for requests whose prompt KV comes from, or goes to, a prefill/decode peer. It never
    touches KV bytes, sockets other than through ``lookup``, or the worker's state."""

    def __init__(
        self, config: ConnectorConfig, block_size: int, lookup: Matcher, remote: RemotePrefill | None = None
    ) -> None:
        self.cfg = config
        self.block_size = block_size
        self.lookup = lookup
        self.remote = remote
        self.flush_blocks = max(1, config.flush_tokens // block_size)
        self._reqs: dict[str, _Req] = {}
        self._plan = StepPlan()

    # ------------------------------------------------------------------ hashing
    def _hashes(self, st: _Req, tokens: Sequence[int], n_blocks: int) -> list[int]:
        """Sequence hashes of the first ``n_blocks`` blocks of ``tokens`` (extended incrementally)."""
        bs = self.block_size
        have = len(st.hashes)
        if n_blocks > have:
            more = block_hashes(tokens[have * bs : n_blocks * bs], bs)
            st.hashes.extend(chain(more, st.hashes[-1] if st.hashes else None))
        return st.hashes[:n_blocks]

    def _state(self, request: Any) -> _Req:
        st = self._reqs.get(request.request_id)
        if st is None or st.request is not request:
            st = self._reqs[request.request_id] = _Req(request)
        return st

    # ------------------------------------------------------------------ vLLM hooks
    def _is_remote(self, request: Any) -> bool:
        return self.remote is not None and self.remote.applies(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        bs = self.block_size
        st = self._state(request)
        st.local, st.asynchronous = num_computed_tokens, False
        if self._is_remote(request):
            return self.remote.matched(request, num_computed_tokens)
        prompt = request.prompt_token_ids or []
        usable = (len(prompt) - 1) // bs  # at least one prompt token is always computed by the engine
        if usable <= 0:
            return 0, False
        if num_computed_tokens >= usable * bs:
            return 0, False
        hashes = self._hashes(st, prompt, usable)
        try:
            n, n_host = self.lookup.match(hashes)
        except Exception as e:  # lookup trouble is a miss, never an engine failure
            log.warning("kvtc lookup failed (%s); treating request %s as a miss", e, request.request_id)
            return 0, False
        ext = n * bs - num_computed_tokens
        if ext <= 0:
            return 0, False
        st.asynchronous = n_host < n  # anything on disk: restore before scheduling
        return ext, st.asynchronous

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        prompt = request.prompt_token_ids or []
        remote = self._is_remote(request)
        if not remote:
            self._plan.lookup_tokens += len(prompt)
        if num_external_tokens <= 0:
            return
        bs = self.block_size
        st = self._state(request)
        block_ids = list(blocks.get_block_ids()[0])
        local = st.local // bs
        n = num_external_tokens // bs
        hashes = self._hashes(st, prompt, local + n)[local : local + n]
        if remote:  # fetched from the prefill peer; saves on this side start after it
            st.load = self.remote.load(request, hashes, block_ids[local : local + n])
        else:
            self._plan.hit_tokens += num_external_tokens
            st.load = LoadOp(request.request_id, hashes, block_ids[local : local + n], st.asynchronous)
        st.saved = max(st.saved, local + n)
        self._plan.loads.append(st.load)

    def build_meta(self, scheduler_output: Any) -> StepPlan:
        num_sched = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue  # not seen by get_num_new_matched_tokens (e.g. a prompt shorter than one block)
            st.block_ids = list(new.block_ids[0])
            self._plan_save(st, new.num_computed_tokens + num_sched.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids and new_ids is not None:
                st.block_ids = list(new_ids[0])  # preempted and resumed: a fresh block table
            elif new_ids is not None:
                st.block_ids.extend(new_ids[0])
            self._plan_save(st, cached.num_computed_tokens[i] + num_sched.get(req_id, 0))
        plan, self._plan = self._plan, StepPlan()
        return plan

    def _plan_save(self, st: _Req, computed: int, final: bool = False) -> bool:
        bs = self.block_size
        req = st.request
        tokens = req.all_token_ids
        n_full = min(computed, len(tokens), len(st.block_ids) * bs) // bs
        pending = n_full - st.saved
        prompt_done = computed >= req.num_prompt_tokens
        flush = final or (prompt_done and not st.prompt_saved) or pending >= self.flush_blocks
        if pending <= 0 or not flush:
            return False
        hashes = self._hashes(st, tokens, n_full)
        a = st.saved
        self._plan.saves.append(
            SaveOp(
                req.request_id,
                hashes[a:n_full],
                hashes[a - 1] if a else None,
                a,
                list(tokens[a * bs : n_full * bs]),
                st.block_ids[a:n_full],
                tail=prompt_done and not st.prompt_saved,
                final=final,
            )
        )
        st.saved = n_full
        st.prompt_saved = st.prompt_saved or prompt_done
        return True

    def request_finished(self, request: Any, block_ids: Sequence[int]) -> tuple[bool, dict | None]:
        """Hold the request's blocks if its last full blocks still need copying out; on a prefill engine, also say
        where the decode side fetches the prompt's KV."""
        st = self._reqs.pop(request.request_id, None)
        held = False
        if st is not None:
            st.block_ids = list(block_ids)
            held = self._plan_save(st, request.num_computed_tokens, final=True)
        params = self.remote.handoff_params(request) if self.remote is not None else None
        return held, params
