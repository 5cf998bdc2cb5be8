"""The scheduler half of the connector: matches requests against the compressed tiers and plans loads and saves.

It owns no KV bytes. Matching asks the worker's store (in the same process, or over the lookup channel when the
workers are separate processes); block keys are 128-bit chained hashes of the request's tokens
(:mod:`dynamo_kvtc.tiers.keys`); the router hears of the same blocks under each key's 64-bit projection. A request
with a cache salt, a LoRA adapter or multimodal inputs keys its blocks with a chain seeded by its
:class:`~dynamo_kvtc.tiers.keys.TenantKey` (see :func:`tenant_of`), so tenants never share blocks; a request whose KV
cannot be keyed safely (prompt embeddings, anything not understood) bypasses the tiers: no match, no save, counted as
``bypass_unkeyable`` in ``stats``.

Saves follow vLLM's block life: a request's prompt blocks are saved in the step its prefill completes (the raw window
on its tail), decode blocks once ``flush_tokens`` new tokens filled blocks, and a finished request's remaining full
blocks in the step after it finished (vLLM holds the blocks until the worker has copied them out).
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ...tiers.keys import TenantKey, block_hashes, chain, router_hash
from ..config import ConnectorConfig
from .lookup import Matcher
from .remote_prefill import RemotePrefill
from .step_plan import LoadOp, SaveOp, StepPlan

log = logging.getLogger(__name__)

BYPASS_UNKEYABLE = "bypass_unkeyable"
LORA_MEMORY = 1 << 17  # hashes of LoRA blocks remembered for their router events (oldest forgotten first)


def tenant_of(request: Any) -> TenantKey | None:
    """The request's :class:`TenantKey`, or None when its KV cannot be keyed safely from what vLLM tells us.

    Keyed: token prompts with an optional string ``cache_salt``, an optional ``lora_request`` (name and id required;
    its path is included, as vLLM does, so a name re-pointed at another adapter gets new keys) and ``mm_features``
    that each carry an identifier and a position. Not keyed: prompt embeddings (``prompt_embeds``, mixed prompts),
    a missing token prompt, or a field of an unexpected type."""
    if getattr(request, "prompt_embeds", None) is not None or getattr(request, "prompt_is_token_ids", None) is not None:
        return None
    if getattr(request, "prompt_token_ids", None) is None:
        return None
    salt = getattr(request, "cache_salt", None)
    if salt is not None and not isinstance(salt, str):
        return None
    name = lid = path = None
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        name, lid, path = (
            getattr(lora, "lora_name", None),
            getattr(lora, "lora_int_id", None),
            getattr(lora, "lora_path", None),
        )
        if not isinstance(name, str) or not name or not isinstance(lid, int) or not isinstance(path, (str, type(None))):
            return None
    mm: list[tuple[str, int, int]] = []
    for feature in getattr(request, "mm_features", None) or ():
        ident, pos = getattr(feature, "identifier", None), getattr(feature, "mm_position", None)
        offset, length = getattr(pos, "offset", None), getattr(pos, "length", None)
        if not ident or not isinstance(offset, int) or not isinstance(length, int):
            return None
        mm.append((str(ident), offset, length))
    return TenantKey(cache_salt=salt or None, lora_name=name, lora_id=lid, lora_path=path, mm=tuple(mm))


@dataclass
class _Req:
    request: Any
    tenant: TenantKey | None = None  # None: unkeyable, the request bypasses the tiers
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
        self,
        config: ConnectorConfig,
        block_size: int,
        lookup: Matcher,
        remote: RemotePrefill | None = None,
        *,
        refuse_loads: bool = False,
    ) -> None:
        self.cfg = config
        self.block_size = block_size
        self.lookup = lookup
        self.remote = remote
        self.refuse_loads = refuse_loads  # a failed restore could fail a request here: match nothing, save still
        self.flush_blocks = max(1, config.flush_tokens // block_size)
        self._reqs: dict[str, _Req] = {}
        self._plan = StepPlan()
        self.stats: Counter[str] = Counter()  # bypass_unkeyable: requests that bypassed the tiers
        self._lora: OrderedDict[int, tuple[int, str]] = OrderedDict()  # saved LoRA block hash -> (lora id, name)

    # ------------------------------------------------------------------ hashing
    def _hashes(self, st: _Req, tokens: Sequence[int], n_blocks: int) -> list[int]:
        """Sequence hashes of the first ``n_blocks`` blocks of ``tokens`` (extended incrementally)."""
        bs = self.block_size
        have = len(st.hashes)
        if n_blocks > have:
            more = block_hashes(tokens[have * bs : n_blocks * bs], bs)
            st.hashes.extend(chain(more, st.hashes[-1] if st.hashes else st.tenant.root()))
        return st.hashes[:n_blocks]

    def _state(self, request: Any) -> _Req:
        st = self._reqs.get(request.request_id)
        if st is None or st.request is not request:
            st = self._reqs[request.request_id] = _Req(request, tenant_of(request))
            if st.tenant is None:
                self.stats[BYPASS_UNKEYABLE] += 1
                self._plan.bypassed += 1  # the workers count it too (their stats feed the metrics)
                log.info(
                    "kvtc: request %s cannot be keyed safely (e.g. prompt embeddings); bypassing the tiers",
                    request.request_id,
                )
        return st

    def hashes_for(self, request: Any, tokens: Sequence[int] | None = None) -> list[int] | None:
        """The block keys this scheduler uses for ``request`` (its prompt, or ``tokens``); None when unkeyable."""
        tenant = tenant_of(request)
        if tenant is None:
            return None
        st = _Req(request, tenant)
        toks = request.prompt_token_ids if tokens is None else tokens
        return self._hashes(st, toks, len(toks) // self.block_size)

    def lora_of(self, block_hash: int) -> tuple[int, str] | None:
        """(lora id, lora name) of a block this scheduler planned to save for a LoRA request, by the 64-bit
        :func:`~dynamo_kvtc.tiers.keys.router_hash` its router events carry."""
        return self._lora.get(block_hash)

    def _remember_lora(self, st: _Req, hashes: Sequence[int]) -> None:
        t = st.tenant
        if t is None or t.lora_name is None:
            return
        for h in map(router_hash, hashes):
            self._lora[h] = (t.lora_id, t.lora_name)
            self._lora.move_to_end(h)
        while len(self._lora) > LORA_MEMORY:
            self._lora.popitem(last=False)

    # ------------------------------------------------------------------ vLLM hooks
    def _is_remote(self, request: Any) -> bool:
        return self.remote is not None and self.remote.applies(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        if self.refuse_loads:
            return 0, False
        bs = self.block_size
        st = self._state(request)
        st.local, st.asynchronous = num_computed_tokens, False
        if st.tenant is None:
            return 0, False
        if self._is_remote(request):
            ext, st.asynchronous = self.remote.matched(request, num_computed_tokens)
            return ext, st.asynchronous
        if self.remote is not None and self.remote.declined(request):
            return 0, False  # left to NixlConnector: claiming a local prefix would keep MultiConnector from it
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
        st = self._state(request)
        if st.tenant is None:
            return
        remote = self._is_remote(request)
        if not remote:
            self._plan.lookup_tokens += len(prompt)
        if num_external_tokens <= 0:
            return
        bs = self.block_size
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
        if st.tenant is None:
            return False
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
        self._remember_lora(st, hashes[a:n_full])
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

    # -------------------------------------------------------------- after a fault in a hook (connector/vllm/guard.py)
    def fail_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """``update_state_after_alloc`` raised: vLLM still expects the ``num_external_tokens`` it was promised to be
        loaded, so plan a load that cannot succeed (no hashes for its blocks: the worker's restore refuses it at once)
        and reports it failed: the request recomputes (the whole request if the promise was asynchronous, from
        these blocks if not) instead of running on blocks nothing wrote."""
        if num_external_tokens <= 0:
            return
        st = self._reqs.get(request.request_id)
        asynchronous = st.asynchronous if st is not None else True
        ids: list[int] = [-1]  # never a real block: the load has one block more than hashes, so it fails
        try:
            local, n = (st.local if st is not None else 0) // self.block_size, num_external_tokens // self.block_size
            ids += list(blocks.get_block_ids()[0])[local : local + n]
        finally:
            op = LoadOp(request.request_id, [], ids, asynchronous)
            if st is not None:
                st.load = op
            self._plan.loads.append(op)

    def take_plan(self) -> StepPlan:
        """``build_meta`` raised: ship what this step planned so far (the loads vLLM waits for above all)."""
        plan, self._plan = self._plan, StepPlan()
        return plan

    def finished_held(self, request: Any) -> tuple[bool, None]:
        """``request_finished`` raised: hold the blocks if a final save of the request is planned (the worker copies
        them out and then reports it done), else nothing; no hand-off params."""
        rid = request.request_id
        return any(s.req_id == rid and s.final for s in self._plan.saves), None
